"""The deltas tables of `weight_sync.py --deltas` (weightSync.deltas over objectstore and collective,
and the storage transport).

Sender and receiver run in one process against Ray's object store (the transport's own work: encoding,
storing, fetching, checking and applying; no process or network in between), each figure the best of
`repeats`. Every sync is checked bit-exact: the engine's tensors are compared byte for byte with the
trainer's after it.

1. A real model's layout (Qwen2.5-0.5B-shaped, bf16, as the other tables) with 1%, 10% and 100% of
   every tensor's elements changed: the bytes an engine one version behind fetches against the whole
   version (goal <= 1.5 x the changed fraction + 1%), and the times of the sync with deltas and of the
   whole one, on both sides: the trainer's publish (the whole version plus, with deltas, encoding the
   deltas) and the engine's receive (the whole version, or the deltas fetched, checked and applied).
   On one host a whole version crosses no network (the engine maps it from the store), so deltas can
   only cost time here; the break-even link speed says over which links they pay: the bytes they save
   divided by the time they add.
2. The tiny Qwen2 (`builtin://tiny-qwen2`) trained for real with AdamW on a language-modelling loss:
   the fraction of elements each step changes and the bytes of its delta, for the weights in float32
   (as the CPU trainer publishes them) and cast to bfloat16 (as GPU trainers publish them).
3. An engine 10 versions behind (1% changed per version) catching up through the chain, against
   fetching the whole latest version.
4. Deltas over `collective` (gloo on loopback, sender and one engine in this process): the same
   layout and fractions, the bytes broadcast against the whole version (same goal) and the time of
   the whole sync (encoding, broadcast, checking and applying) against a whole version's.
5. The `storage` transport on a local directory (file://; an object store adds its network on top):
   the bytes it writes for a version of 1% changed elements against a whole version (goal <= 1.5 x
   the changed fraction + 1%), an engine one version behind, and an engine that joins 10 versions
   after the newest whole one (the whole version and the 10 deltas since) against one that fetches a
   whole version (fullEvery 1).
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import torch

from polyrl_runtime.weights import SyncReport, TensorTarget, WeightSender, make_receiver, make_sender
from polyrl_runtime.weights.collective import CollectiveReceiver, CollectiveSender
from polyrl_runtime.weights.registry import sender_options

MiB = 1 << 20


def changed(tensors: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """A copy of `tensors` with `fraction` of each one's elements changed (new bits, exactly that many)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        new = t.clone()
        n = round(t.numel() * fraction)
        if n:
            idx = torch.randperm(t.numel(), generator=g)[:n]
            flat = new.view(-1)
            flat[idx] = flat[idx] + torch.randn(n, generator=g).to(t.dtype) + 1
        out[name] = new
    return out


def exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[n].view(torch.uint8), b[n].contiguous().view(torch.uint8)) for n in a)


class Pair:
    """A sender and a receiver of one policy in this process; `engine` holds what was received."""

    def __init__(self, base: dict[str, torch.Tensor], deltas: int) -> None:
        self.sender = make_sender("objectstore", "p", 256 * MiB, deltas=deltas)
        self.receiver = make_receiver("objectstore")
        self.version = 0
        self.sender.publish(0, base)
        self.engine = TensorTarget({n: t.clone() for n, t in base.items()}, 0, swappable=True)

    def publish(self, tensors: dict[str, torch.Tensor]) -> tuple[object, float]:
        self.version += 1
        t0 = time.perf_counter()
        manifest = self.sender.publish(self.version, tensors)
        return manifest, time.perf_counter() - t0

    def receive(self, manifest: object) -> tuple[int, float]:
        t0 = time.perf_counter()
        report = self.receiver.receive(manifest, self.engine)  # type: ignore[arg-type]
        return report.nbytes, time.perf_counter() - t0

    def close(self) -> None:
        self.sender.close()


def layout_table(layout: dict[str, torch.Tensor], repeats: int) -> bool:
    full = sum(t.numel() * t.element_size() for t in layout.values())
    print(
        f"\ndeltas, real layout ({len(layout)} tensors, {full / MiB:.0f} MiB bf16), engine one version behind"
    )
    print(
        "| changed | bytes fetched / whole | goal | publish ms, deltas / whole | receive ms, deltas / whole "
        "| break-even link GB/s | bit-exact |"
    )
    print("|---|---|---|---|---|---|---|")
    ok = True
    for fraction in (0.01, 0.10, 1.0):
        new = changed(layout, fraction, seed=int(fraction * 100))
        sides = {}
        for keep in (0, 1):  # the whole version alone, then with the deltas from the version before
            pub, rec, nbytes = math.inf, math.inf, 0
            for _ in range(repeats):
                pair = Pair(layout, deltas=keep)
                manifest, p = pair.publish(new)
                nbytes, r = pair.receive(manifest)
                ok = ok and exact(new, dict(pair.engine.named_tensors()))
                pair.close()
                pub, rec = min(pub, p), min(rec, r)
            sides[keep] = (pub, rec, nbytes)
        (pub_w, rec_w, whole), (pub_d, rec_d, fetched) = sides[0], sides[1]
        ratio = fetched / whole
        goal = 1.5 * fraction + 0.01
        extra_s = (pub_d + rec_d) - (pub_w + rec_w)
        saved = whole - fetched
        even = f"{saved / extra_s / 1e9:.2f}" if extra_s > 0 and saved > 0 else "-"
        print(
            f"| {fraction:.0%} | {ratio:.4f} | <= {goal:.3f} {'met' if ratio <= goal else 'not met'} "
            f"| {pub_d * 1e3:.0f} / {pub_w * 1e3:.0f} | {rec_d * 1e3:.0f} / {rec_w * 1e3:.0f} | {even} "
            f"| {'yes' if ok else 'NO'} |",
            flush=True,
        )
    return ok


def training_table(steps: int) -> None:
    from transformers import AutoModelForCausalLM

    from polyrl_runtime.models.tiny_qwen2 import create_tiny_qwen2

    with TemporaryDirectory() as d:
        model = AutoModelForCausalLM.from_pretrained(create_tiny_qwen2(Path(d) / "m"), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(0)
    print(f"\ndeltas, builtin://tiny-qwen2 trained with AdamW (lr 1e-5), {steps} steps")
    print("| dtype published | elements changed per step | delta bytes / whole | bit-exact |")
    print("|---|---|---|---|")
    history: list[dict[str, torch.Tensor]] = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (4, 32), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    for dtype in (torch.float32, torch.bfloat16):
        versions = [{n: t.to(dtype) for n, t in v.items()} for v in history]
        pair = Pair(versions[0], deltas=1)
        numel = sum(t.numel() for t in versions[0].values())
        whole = sum(t.numel() * t.element_size() for t in versions[0].values())
        fractions, ratios, ok = [], [], True
        for prev, new in itertools.pairwise(versions):
            fractions.append(
                sum(int((a != b).sum()) for a, b in zip(prev.values(), new.values(), strict=True)) / numel
            )
            manifest, _ = pair.publish(new)
            nbytes, _ = pair.receive(manifest)
            ratios.append(nbytes / whole)
            ok = ok and exact(new, dict(pair.engine.named_tensors()))
        pair.close()
        print(
            f"| {str(dtype).removeprefix('torch.')} | {sum(fractions) / len(fractions):.1%} "
            f"| {sum(ratios) / len(ratios):.3f} | {'yes' if ok else 'NO'} |",
            flush=True,
        )


def catch_up_table(layout: dict[str, torch.Tensor], behind: int, repeats: int) -> None:
    versions = [layout]
    for v in range(1, behind + 1):
        versions.append(changed(versions[-1], 0.01, seed=v))
    print(
        f"\ndeltas, an engine {behind} versions behind (1% changed per version) against the whole latest version"
    )
    print("| way | bytes fetched | receive ms | bit-exact |")
    print("|---|---|---|---|")
    rows = {}
    for way, keep in (("deltas", behind), ("whole", 0)):
        best: tuple[float, int, bool] = (math.inf, 0, False)
        for _ in range(repeats):
            pair = Pair(layout, deltas=keep)
            manifest = None
            for v in versions[1:]:
                manifest, _ = pair.publish(v)
            nbytes, took = pair.receive(manifest)
            best = min(best, (took, nbytes, exact(versions[-1], dict(pair.engine.named_tensors()))))
            pair.close()
        rows[way] = best
        print(f"| {way} | {best[1] / MiB:.2f} MiB | {best[0] * 1e3:.0f} | {'yes' if best[2] else 'NO'} |")
    (t_d, b_d, _), (t_w, b_w, _) = rows["deltas"], rows["whole"]
    print(f"catch-up, deltas / whole: bytes {b_d / b_w:.3f}, receive time {t_d / t_w:.2f}")


def _storage_sender(root: str, full_every: int) -> WeightSender:
    return make_sender(
        "storage", "p", 256 * MiB, **sender_options("storage", receivers=1, uri=root, full_every=full_every)
    )


def storage_table(layout: dict[str, torch.Tensor], behind: int, repeats: int) -> bool:
    """Table 5; True when every sync was bit-exact."""
    versions = [layout]
    for v in range(1, behind + 1):
        versions.append(changed(versions[-1], 0.01, seed=v))
    zeros = {n: torch.zeros_like(t) for n, t in layout.items()}
    rows: dict[str, tuple[float, int, bool]] = {}

    def keep(what: str, took: float, nbytes: int, ok: bool) -> None:
        rows[what] = min(rows.get(what, (math.inf, 0, True)), (took, nbytes, ok))

    for _ in range(repeats):
        with TemporaryDirectory() as tmp:
            sender = _storage_sender(f"file://{tmp}/chain", full_every=behind + 1)
            receiver = make_receiver("storage")
            follower = TensorTarget(dict(zeros), -1, swappable=True)
            t0 = time.perf_counter()
            manifest = sender.publish(0, versions[0])
            keep("write: whole version", time.perf_counter() - t0, manifest.handle.nbytes, True)
            receiver.receive(manifest, follower)
            for v in range(1, behind + 1):
                t0 = time.perf_counter()
                manifest = sender.publish(v, versions[v])
                keep(
                    "write: a version as its delta (1% changed)",
                    time.perf_counter() - t0,
                    manifest.deltas[-1].nbytes,
                    True,
                )
                t0 = time.perf_counter()
                report = receiver.receive(manifest, follower)
                ok = exact(versions[v], dict(follower.named_tensors()))
                keep("engine one version behind: its delta", time.perf_counter() - t0, report.nbytes, ok)
            joiner = TensorTarget(dict(zeros), -1, swappable=True)
            t0 = time.perf_counter()
            report = receiver.receive(manifest, joiner)
            ok = exact(versions[-1], dict(joiner.named_tensors()))
            keep(
                f"engine joining: whole version + {behind} deltas",
                time.perf_counter() - t0,
                report.nbytes,
                ok,
            )
            wholes = _storage_sender(f"file://{tmp}/whole", full_every=1)
            manifest = wholes.publish(behind, versions[-1])
            joiner = TensorTarget(dict(zeros), -1, swappable=True)
            t0 = time.perf_counter()
            report = receiver.receive(manifest, joiner)
            ok = exact(versions[-1], dict(joiner.named_tensors()))
            keep("engine joining: whole version (fullEvery 1)", time.perf_counter() - t0, report.nbytes, ok)
    print(f"\nstorage transport on a local directory, fullEvery {behind + 1}, best of {repeats}")
    print("| what | bytes | ms | bit-exact |")
    print("|---|---|---|---|")
    for what, (took, nbytes, ok) in rows.items():
        print(f"| {what} | {nbytes / MiB:.2f} MiB | {took * 1e3:.0f} | {'yes' if ok else 'NO'} |")
    whole_bytes = rows["write: whole version"][1]
    delta = rows["write: a version as its delta (1% changed)"]
    print(f"storage, a delta version / a whole one: bytes {delta[1] / whole_bytes:.4f} (goal <= 0.0250)")
    (t_c, b_c, _), (t_w, b_w, _) = (
        rows[f"engine joining: whole version + {behind} deltas"],
        rows["engine joining: whole version (fullEvery 1)"],
    )
    print(
        f"storage, joining through {behind} deltas / a whole version: bytes {b_c / b_w:.3f}, receive time {t_c / t_w:.2f}"
    )
    return all(ok for _, _, ok in rows.values())


def _collective_sync(
    sender: CollectiveSender,
    receiver: CollectiveReceiver,
    engine: TensorTarget,
    version: int,
    tensors: dict[str, torch.Tensor],
) -> SyncReport:
    manifest = sender.publish(version, tensors)
    got: list[SyncReport] = []
    thread = threading.Thread(target=lambda: got.append(receiver.receive(manifest, engine)))
    thread.start()
    thread.join()
    sender.wait()
    return got[0]


def collective_table(layout: dict[str, torch.Tensor], repeats: int) -> bool:
    """Table 4; True when every sync was bit-exact."""
    print("\ndeltas over collective (gloo on loopback, one engine), engine one version behind")
    print("| changed | bytes sent / whole | goal | sync ms, deltas / whole | time ratio | bit-exact |")
    print("|---|---|---|---|---|---|")
    ok = True
    for fraction in (0.01, 0.10, 1.0):
        new = changed(layout, fraction, seed=int(fraction * 100))
        sides = {}
        for deltas in (0, 1):
            best, nbytes = math.inf, 0
            for _ in range(repeats):
                sender = CollectiveSender(
                    "p", 256 * MiB, num_receivers=1, host="127.0.0.1", timeout_s=300.0, deltas=deltas
                )
                receiver = CollectiveReceiver(timeout_s=300.0)
                engine = TensorTarget({n: torch.zeros_like(t) for n, t in layout.items()}, -1, swappable=True)
                _collective_sync(sender, receiver, engine, 0, layout)
                sender.release_source()  # as a trainer does before its step
                t0 = time.perf_counter()
                report = _collective_sync(sender, receiver, engine, 1, new)
                best, nbytes = min(best, time.perf_counter() - t0), report.nbytes
                ok = ok and exact(new, dict(engine.named_tensors()))
                sender.close()
                receiver.close()
            sides[deltas] = (best, nbytes)
        (t_w, whole), (t_d, sent) = sides[0], sides[1]
        goal = 1.5 * fraction + 0.01
        ratio = sent / whole
        print(
            f"| {fraction:.0%} | {ratio:.4f} | <= {goal:.3f} {'met' if ratio <= goal else 'not met'} "
            f"| {t_d * 1e3:.0f} / {t_w * 1e3:.0f} | {t_d / t_w:.2f} | {'yes' if ok else 'NO'} |",
            flush=True,
        )
    return ok
