"""Run a benchmark script with import stubs for libp2p and multiaddr (absent on this machine).

Every name taken from a stubbed module is a placeholder class; creating one is allowed (module-level constants),
but touching any attribute of a placeholder instance, or of the module beyond import, raises: a benchmark that ran
through did not use libp2p.
    python shimrun.py bench/bench_x.py ARGS...
"""
import importlib.abc
import importlib.machinery
import runpy
import sys
import types

STUBBED = ("libp2p", "multiaddr")


class _Used(RuntimeError):
    pass


class _Meta(type):
    def __getattr__(cls, attr):  # class-level names (module-level patching at import) are placeholders too
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _placeholder(f"{cls.__name__}.{attr}")


def _placeholder(name):
    def __init__(self, *a, **k):
        pass

    def __getattr__(self, attr):
        raise _Used(f"stub {name}.{attr} used: libp2p is not installed here")

    def __call__(self, *a, **k):
        raise _Used(f"stub {name} called: libp2p is not installed here")

    return _Meta(name.rsplit(".", 1)[-1], (), {"__init__": __init__, "__getattr__": __getattr__,
                                              "__call__": __call__, "__class_getitem__": classmethod(lambda c, i: c)})


class _Mod(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        v = _placeholder(f"{self.__name__}.{attr}")
        setattr(self, attr, v)
        return v


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Mod(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


for n in list(sys.modules):
    if n.split(".")[0] in STUBBED:
        del sys.modules[n]
sys.meta_path.insert(0, _Finder())
script, *args = sys.argv[1:]
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
