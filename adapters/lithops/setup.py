"""Build hook of ``pocketflow-lithops``: writes ``pocketflow_lithops.pth`` next to the package; the
rest is setup.cfg.

The ``.pth`` file imports ``_pocketflow_lithops`` at interpreter start, which makes Lithops find
the ``pocket`` storage backend in every process, workers included. A wheel carries it at its
root (so it lands in site-packages); an editable install (``pip install -e``) writes it into the
editable wheel's root, since ``build_py`` output is not packed in that mode.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "pocketflow_lithops.pth"
# Sorted after "__editable__.*.pth", so an editable install's finder is in place when it runs.
# It imports the hook only when it can be found: an editable install whose source tree is gone
# must not print a traceback at the start of every Python process on the machine.
PTH_LINE = (
    "import importlib.util as _pf_util; "
    "_pf_util.find_spec('_pocketflow_lithops') and __import__('_pocketflow_lithops')\n"
)


class BuildPyWithPth(build_py):
    """``build_py`` that also writes the import-hook ``.pth`` file."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            target_dir = self.get_finalized_command("install").install_lib
        else:
            target_dir = self.build_lib
        os.makedirs(target_dir, exist_ok=True)
        with open(os.path.join(target_dir, PTH_NAME), "w", encoding="utf-8") as f:
            f.write(PTH_LINE)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, PTH_NAME))
        return outputs


setup(cmdclass={"build_py": BuildPyWithPth})
