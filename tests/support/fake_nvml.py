"""The fake NVML hosts the tests use: ``xfuser_swiftfusion.emulation.nvml``."""
from xfuser_swiftfusion.emulation.nvml import *  # noqa: F401,F403
from xfuser_swiftfusion.emulation.nvml import FakeNVML  # noqa: F401
