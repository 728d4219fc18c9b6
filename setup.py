"""Ships ``xfuser_swiftfusion_autoload.pth`` into site-packages (metadata lives in pyproject.toml).

A ``.pth`` file must sit at the root of site-packages, which package data cannot reach:
- ``pip install .``: ``build_py`` copies it into the wheel root;
- ``pip install -e .`` (PEP 660): setuptools builds the editable wheel from the files of its
  unpacked-wheel directory (dist-info, namespace .pth files); ``editable_wheel`` adds ours there.
"""
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "xfuser_swiftfusion_autoload.pth"


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        if not self.editable_mode:
            self.copy_file(PTH, os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        extra = [] if self.editable_mode else [os.path.join(self.build_lib, PTH)]
        return [*super().get_outputs(include_bytecode), *extra]


class editable_wheel_with_pth(editable_wheel):
    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        files, mapping = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        shutil.copyfile(PTH, os.path.join(unpacked_wheel, PTH))
        return files, mapping


if not hasattr(editable_wheel, "_run_build_commands"):
    raise RuntimeError("this setuptools has no editable_wheel._run_build_commands; the editable "
                       "install could not ship xfuser_swiftfusion_autoload.pth (pin setuptools<=84)")

setup(cmdclass={"build_py": build_py_with_pth, "editable_wheel": editable_wheel_with_pth})
