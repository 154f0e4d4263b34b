"""The one table of supported model families, keyed by Hugging Face `model_type`.

Both loaders (loader/hf.py by `model_type`, loader/gguf.py by `general.architecture`), the
conversion cache's config reader (loader/checkpoint.py) and llm.build_engine (which model class to
build) read it; nothing else lists architectures, and config.py knows none (ModelConfig refuses no
architecture: `family(name)` here does).

Adding a family: write `ridgefill_runtime/models/<name>.py` defining a `ModelFamily` (see
family.py; llama.py and qwen3.py are examples; gemma3.py also defines its own settings, a
FamilyConfig subclass named in `config_class`), and add it to BUILT_IN below. A test or plugin
can add one at run time instead:

    from ridgefill_runtime.models.registry import register, unregister
    register(ModelFamily(name="tiny-loop", model_class=TinyLoopLM, parse_hf_config=my_parser,
                         weight_names=my_names, config_class=TinyLoopConfig))
    ...  # HF folders with model_type "tiny-loop" load (my_parser puts a TinyLoopConfig in
    ...  # ModelConfig.family_config); build_engine builds TinyLoopLM
    unregister("tiny-loop")

`register` refuses a name (or GGUF architecture) already taken unless `replace=True`.
"""

from __future__ import annotations

from ..errors import UnsupportedError
from .family import ModelFamily
from .llama import LLAMA
from .qwen2 import QWEN2
from .qwen3 import QWEN3
from .qwen3_5 import QWEN3_5, QWEN3_5_TEXT
from .qwen3_next import QWEN3_NEXT
from .huginn import HUGINN_RAVEN
from .gemma3 import GEMMA3

BUILT_IN = (LLAMA, QWEN2, QWEN3, QWEN3_5_TEXT, QWEN3_5, QWEN3_NEXT, HUGINN_RAVEN, GEMMA3)

_FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily, *, replace: bool = False) -> ModelFamily:
    if not isinstance(family, ModelFamily):
        raise TypeError(f"register() takes a ModelFamily, got {type(family).__name__}")
    if not replace:
        if family.name in _FAMILIES:
            raise ValueError(f"model family {family.name!r} is already registered")
        if family.gguf is not None and family.gguf.architecture in gguf_architectures():
            raise ValueError(f"GGUF architecture {family.gguf.architecture!r} is already registered")
    _FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    _FAMILIES.pop(name, None)


def supported() -> tuple[str, ...]:
    """Every registered family name, in registration order."""
    return tuple(_FAMILIES)


def gguf_architectures() -> tuple[str, ...]:
    return tuple(f.gguf.architecture for f in _FAMILIES.values() if f.gguf is not None)


def family(name: str) -> ModelFamily:
    """The family of ModelConfig.architecture `name`."""
    found = _FAMILIES.get(name)
    if found is None:
        raise UnsupportedError(f"unsupported architecture {name!r} (supported: {', '.join(supported())})")
    return found


def family_for_model_type(model_type, where: str) -> ModelFamily:
    """The family of a config.json's `model_type`; `where` names the file in the refusal."""
    found = _FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if found is None:
        raise UnsupportedError(
            f"{where}: unsupported architecture model_type={model_type!r} (supported: {', '.join(supported())})"
        )
    return found


def family_for_gguf(architecture: str, where: str) -> ModelFamily:
    """The family whose GGUF files name `architecture` in general.architecture."""
    for candidate in _FAMILIES.values():
        if candidate.gguf is not None and candidate.gguf.architecture == architecture:
            return candidate
    raise UnsupportedError(
        f"{where}: GGUF architecture {architecture!r} is not supported (supported: {', '.join(gguf_architectures())})"
    )


for _family in BUILT_IN:
    register(_family)
