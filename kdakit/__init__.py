"""kdakit: GPU inference kernels for Kimi Delta Attention (KDA) serving."""
__version__ = "0.1.0"

from . import backends, contracts, reference  # noqa: E402
from .ops.commit import commit_ring, commit_snapshots  # noqa: E402
from .ops.mtp_verify import mtp_verify  # noqa: E402
from .ops.packed_decode import packed_decode  # noqa: E402

__all__ = ["__version__", "backends", "contracts", "reference", "packed_decode", "mtp_verify", "commit_ring",
           "commit_snapshots"]
