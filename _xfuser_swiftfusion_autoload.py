"""Loads the xfuser-swiftfusion plugin when a process imports ``xfuser``.

Imported at interpreter start by ``xfuser_swiftfusion_autoload.pth`` (site-packages). It
registers one wrapt post-import hook on ``xfuser.envs``, the first xFuser module that executes
(before the rest of xFuser reads it: the CPU compatibility patches must land there); processes
that never import xFuser never load the plugin (no torch import). It never raises: if the
package is half-installed or broken, xFuser runs unmodified and one line on stderr says why.
``SWIFTFUSION_AUTOLOAD=0`` disables it.
"""
import os
import sys


def _load(module):
    try:
        from xfuser_swiftfusion.integrations import xfuser as integration
        integration.install()  # its hooks on xfuser.envs run at once: it has just executed
    except Exception as exc:  # noqa: BLE001  (must never break the interpreter)
        sys.stderr.write(f"xfuser-swiftfusion: plugin not loaded ({type(exc).__name__}: "
                         f"{exc}); xFuser runs without --sp-strategy\n")


def _install():
    if os.environ.get("SWIFTFUSION_AUTOLOAD", "1") == "0" or "xfuser" in sys.modules:
        return
    try:
        import wrapt
    except ImportError:
        return
    wrapt.register_post_import_hook(_load, "xfuser.envs")


_install()
