"""Loads the xfuser-swiftfusion plugin the first time a process imports ``xfuser``.

Imported at interpreter start by ``xfuser_swiftfusion_autoload.pth`` (site-packages). Until
``xfuser`` is imported it only costs one string comparison per module import; processes that
never import xFuser never load the plugin (no torch import). It never raises: if the package is
half-installed or broken, xFuser runs unmodified and one line on stderr says why.
``SWIFTFUSION_AUTOLOAD=0`` disables it.
"""
import os
import sys


class _FirstXfuserImport:
    """``sys.meta_path`` entry that loads the plugin just before ``xfuser`` executes."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if fullname != "xfuser":
            return None
        _uninstall()
        try:
            from xfuser_swiftfusion import xfuser_plugin
            xfuser_plugin.install()
        except Exception as exc:  # noqa: BLE001  (must never break the interpreter)
            sys.stderr.write(f"xfuser-swiftfusion: plugin not loaded ({type(exc).__name__}: "
                             f"{exc}); xFuser runs without --sp-strategy\n")
        return None  # the regular finders import xfuser


def _uninstall():
    sys.meta_path[:] = [f for f in sys.meta_path if f is not _FirstXfuserImport]


def _install():
    if os.environ.get("SWIFTFUSION_AUTOLOAD", "1") == "0" or "xfuser" in sys.modules:
        return
    if _FirstXfuserImport not in sys.meta_path:
        sys.meta_path.insert(0, _FirstXfuserImport)


_install()
