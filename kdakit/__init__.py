"""kdakit: GPU inference kernels for Kimi Delta Attention (KDA) serving."""
__version__ = "0.2.0"

from . import backends, contracts, errors, reference  # noqa: E402
from .errors import take_errors  # noqa: E402
from .ops.commit import commit_ring, commit_snapshots  # noqa: E402
from .ops.conv1d_update import causal_conv1d_update  # noqa: E402
from .ops.conv1d_varlen import causal_conv1d_varlen  # noqa: E402
from .ops.fused_decode import fused_decode  # noqa: E402
from .ops.gated_rmsnorm import gated_rmsnorm  # noqa: E402
from .ops.mtp_verify import mtp_verify  # noqa: E402
from .ops.packed_decode import packed_decode  # noqa: E402
# packed_decode's helion backend registers itself on import (helion loads on first use)
from .ops import packed_decode_helion  # noqa: E402,F401
from .ops.recurrent_forward import recurrent_forward  # noqa: E402
from .ops.tree_commit import commit_tree_ring  # noqa: E402
from .ops.tree_verify import tree_verify  # noqa: E402
from .ops.chunk_prefill import chunk_prefill  # noqa: E402

__all__ = ["__version__", "backends", "contracts", "errors", "reference", "take_errors", "packed_decode",
           "fused_decode", "causal_conv1d_update", "causal_conv1d_varlen", "gated_rmsnorm", "mtp_verify",
           "commit_ring", "commit_snapshots", "recurrent_forward", "tree_verify", "commit_tree_ring",
           "chunk_prefill"]
