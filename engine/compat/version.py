"""`deepspeed.__version__` under deepfleet: deepfleet's own version, and the DeepSpeed release whose API
names and config keys this engine follows (`__deepspeed_compat_version__`, also what the `deepspeed`
distribution that `deepfleet run` presents to a script reports)."""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("deepfleet")
except metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"

__deepspeed_compat_version__ = "0.19.8"
