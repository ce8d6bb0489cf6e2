"""Two policies' engines on one pool pod (one process here, as one pod hosts one engine of each
policy): pausing and updating one policy's engine never stops the other's generation."""

from __future__ import annotations

import asyncio

from polyrl_runtime.engines.api import SamplingParams
from polyrl_runtime.engines.torch_engine import TorchEngine
from polyrl_runtime.models.tiny import build_tiny
from polyrl_runtime.weights import make_sender


def test_while_one_policy_updates_the_other_policy_s_requests_complete() -> None:
    solver = TorchEngine("solver-0", "solver", "builtin://tiny", transport="shm", seed=3)
    verifier = TorchEngine("verifier-0", "verifier", "builtin://tiny", transport="shm", seed=4)
    sender = make_sender("shm", "solver", 1 << 20)
    try:
        v0 = sender.publish(0, dict(solver.target.named_tensors()))
        new = {k: p.detach().clone() for k, p in build_tiny("tiny", 64, seed=99).named_parameters()}
        params = SamplingParams(max_new_tokens=20)

        before = verifier.weight_version()

        async def go() -> tuple[list[int], int, int]:
            assert (await solver.receive_weights(v0)).applied
            solving = asyncio.create_task(solver.generate([1, 10], params))
            while not solver._active or len(solver._active[0].tokens) < 3:
                await asyncio.sleep(0.001)
            await solver.pause()  # the solver's update begins: its generation stops between two tokens
            # the verifier serves a whole request meanwhile, on the same pod
            verified = await asyncio.wait_for(verifier.generate([2, 11], params), timeout=60)
            assert not solving.done()  # the solver is still paused: the verifier did not wait for it
            assert (await solver.receive_weights(sender.publish(1, new))).applied
            await solver.resume()
            return (await solving).versions.tolist(), len(verified.token_ids), verifier.weight_version()

        versions, verified_tokens, verifier_version = asyncio.run(go())
    finally:
        sender.close()
    assert verified_tokens == 20 and verifier_version == before  # untouched by the solver's update
    assert versions[0] == 0 and versions[-1] == 1  # the solver continued on its new weights
