"""Optional dependencies: import one where it is needed, or say which extra installs it.

``pip install plait`` brings torch, safetensors and numpy; the rest is an extra, imported
only by the part that uses it: ``plait[hf]`` (transformers, for Hugging Face models),
``plait[demo]`` (scikit-learn, matplotlib, tqdm: ``plait demo`` and the plots),
``plait[test]`` and ``plait[docs]``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS = {
    "transformers": "hf",
    "tqdm": "demo",
    "sklearn": "demo",
    "matplotlib": "demo",
    "tensorboard": "metrics",
    "wandb": "metrics",
}


def require(module: str, *, why: str) -> ModuleType:
    """``import module``, or an ``ImportError`` that names what needed it and the extra
    that installs it (``pip install 'plait[hf]'``)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.partition(".")[0]
        extra = EXTRAS.get(top)
        how = f"pip install 'plait[{extra}]'" if extra else f"pip install {top}"
        raise ImportError(f"{why} needs {top}, which is not installed ({exc}); {how}") from exc
