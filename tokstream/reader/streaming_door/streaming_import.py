"""Import streaming without transformers and torchvision, which training never uses, until something does.

`import streaming` imports transformers for `BatchFeature` and `BatchEncoding`, which
StreamingDataLoader checks batches against, and it imports its own datasets for C4 and the Pile
(transformers' AutoTokenizer), CIFAR-10, ImageNet and the like (torchvision, which imports
torch._dynamo): 4.6 of the 4.9 s that `import streaming` took after torch here, in every
rank at every start (bench/import_time.py). Here, while streaming imports:

- `BatchFeature` and `BatchEncoding` are stand-in classes. `isinstance(x, BatchFeature)` is False
  without importing anything while transformers is not imported (no instance of its classes can
  exist before); after that, it is the real check. Any attribute or call goes to the real class.
  These stand-in modules leave `sys.modules` once streaming is imported: a later
  `import transformers` is the real one.
- `streaming.text`, `streaming.vision` and `streaming.multimodal` are stand-in modules that import
  the real package on first use of one of its names, so `from streaming.vision import ...` works.

If transformers or streaming is already imported, or streaming asks transformers for other names
(a version this was not written for), streaming is imported the ordinary way.
"""

import importlib
import importlib.util
import sys
import types
from pathlib import Path

# What streaming's base imports from transformers (streaming/base/dataloader.py): mosaicml-streaming 0.13.0
# from the submodules, streaming-community 0.14 from the package.
_DEFERRED = {
    "transformers.feature_extraction_utils": ("BatchFeature",),
    "transformers.tokenization_utils_base": ("BatchEncoding",),
    "transformers": ("BatchEncoding", "BatchFeature"),
}
_HOME_OF = {"BatchFeature": "transformers.feature_extraction_utils", "BatchEncoding": "transformers.tokenization_utils_base"}

STREAMING_MISSING = ("tokstream's reader needs the `streaming` module, which neither mosaicml-streaming nor "
                     "streaming-community provides here: pip install 'tokstream[mosaicml]' or 'tokstream[community]'")

# streaming's own datasets (C4 and the Pile need transformers, the vision ones torchvision).
_LAZY_SUBPACKAGES = ("streaming.multimodal", "streaming.text", "streaming.vision")


class _DeferredClass(type):
    """Metaclass of a stand-in for the transformers class of the same name in `_module`."""

    def _real(cls) -> type:
        return getattr(importlib.import_module(cls._module), cls.__name__)

    def __instancecheck__(cls, instance) -> bool:
        return cls._module in sys.modules and isinstance(instance, cls._real())

    def __subclasscheck__(cls, subclass) -> bool:
        return cls._module in sys.modules and issubclass(subclass, cls._real())

    def __getattr__(cls, name: str):
        return getattr(cls._real(), name)

    def __call__(cls, *args, **kwargs):
        return cls._real()(*args, **kwargs)


def import_streaming() -> types.ModuleType:
    """`import streaming`, with transformers deferred as described above; returns the module."""
    if "streaming" in sys.modules or "transformers" in sys.modules:
        return importlib.import_module("streaming")
    if importlib.util.find_spec("streaming") is None:
        raise ImportError(STREAMING_MISSING)
    stand_ins = _stand_in_modules()
    sys.modules.update(stand_ins)
    home = Path(importlib.util.find_spec("streaming").origin).parent  # finds it, runs nothing
    for name in _LAZY_SUBPACKAGES:
        sys.modules[name] = _DeferredModule(name, str(home / name.split(".")[1] / "__init__.py"))
    try:
        return importlib.import_module("streaming")
    except ImportError:  # it wants more of transformers than this knows: the ordinary import
        for name in [name for name in sys.modules if name == "streaming" or name.startswith("streaming.")]:
            del sys.modules[name]
        for name in stand_ins:
            sys.modules.pop(name, None)  # before the ordinary import, not after it (as `finally` would)
        return importlib.import_module("streaming")
    finally:
        for name, module in stand_ins.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]


class _DeferredModule(types.ModuleType):
    """Stand-in for a package, which imports it on first access to one of its names. Dunder names
    other than `__path__` (an import of a submodule) and `__all__` (`import *`) do not count:
    tools that walk `sys.modules` (inspect.getmodule, on every torch.library registration) read
    `__file__` and the like of every module, which must not import them all."""

    def __init__(self, name: str, file: str) -> None:
        super().__init__(name)
        self.__file__ = file

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__") and name not in ("__path__", "__all__"):
            raise AttributeError(name)
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), name)


def _stand_in_modules() -> dict[str, types.ModuleType]:
    modules: dict[str, types.ModuleType] = {}
    for module_name, class_names in _DEFERRED.items():
        parts = module_name.split(".")
        for depth in range(1, len(parts) + 1):  # the packages above it too: `from a.b.c import X` imports a, a.b
            name = ".".join(parts[:depth])
            if name not in modules:
                modules[name] = types.ModuleType(name)
                modules[name].__path__ = []  # a package, so that its submodules' imports resolve here
        for class_name in class_names:  # one stand-in per class, wherever streaming imports it from
            home = _HOME_OF[class_name]
            stand_in = getattr(modules.get(home), class_name, None) or _DeferredClass(class_name, (), {"_module": home})
            setattr(modules[module_name], class_name, stand_in)
    return modules
