"""What every attention backend says about itself (`cartridge.attention.backends` lists them)."""

import mlx.core as mx

MODES = ("decode", "prefill")  # decode: at most 8 query rows per KV head; prefill: a question over the prefix


class AttentionBackend:
    """One way decode steps read a layer's prefix pages; subclass it and add one line to the registry.

    Two kinds of entry share this class:

    - a device entry (`default_policy` set): names the device it runs on ("cpu", "cuda", "metal") and the
      policy `auto` takes there where the measured table has no case;
    - a kernel entry (`policy` set): the layers it reads (`supports`), the record it lays out from a layer's pages
      at load (`build`: data, kept as `LayerPrefix.backend`) and the attention it computes from that record and
      a cache's tail (`attend`); `None` from either means the portable path.

    A device entry whose device reads a question's prefill itself (the CPU's) builds and attends the same way.

    Attributes:
        name (str): the backend's name, as `cartridge bench`, the tables and the proofs record it.
        device (str | None): the device it runs on (a device entry's name), None for every device.
        policy (str | None): the attention policy (`cartridge.attention.policy.POLICIES`) whose layers it reads.
        default_policy (str | None): a device entry's choice where the table has no measurement.
        needs_proof (bool): `auto` routes to it only after it has matched the portable path on this machine
            (`cartridge.attention.backends.proof`); a kernel never run where it is shipped sets it.
    """

    name = ""
    device = None
    policy = None
    default_policy = None
    needs_proof = False

    def is_current(self):
        """A device entry: True if MLX's default device is this device."""
        return False

    def available(self):
        """True if this backend can run here (its device is the default one and its code loads)."""
        return True

    def reads(self, codecs):
        """True if the backend reads stored sides of these codecs (tier names only, as a header knows them)."""
        return True

    def supports(self, prefix, head_dim, mode):
        """True if the backend reads this layer.

        Args:
            prefix (LayerPrefix): the layer's pages (tiers, rotation records, page size; sinks and windows
                are per call: the callable returns None for a call it cannot serve).
            head_dim (int): the layer's K head_dim. mode (str): "decode" or "prefill" (`MODES`).
        """
        return True

    def build(self, prefix):
        """What this backend lays out from the layer's pages, once at load: a record (data, not callable) whose
        `name` is this entry's, kept as `LayerPrefix.backend`; None here: the portable path always."""
        return None

    def attend(self, record, prefix, queries, tail, scale, sinks, scratch):
        """Attention of the last L tail tokens over prefix + tail, causal among the tail (what
        `CartridgeCache.attention` gives), from arguments only: it reads no cache.

        Args:
            record: what `build` laid out for this layer. prefix (LayerPrefix): the layer's pages.
            queries (mx.array): (1, n_q_heads, L, head_dim). tail (state.Tail): the cache's dense tail, whose
                last L tokens are the queries'. scale (float): softmax scale.
            sinks (mx.array | None): (n_q_heads,) sink logits (gpt-oss), or None.
            scratch (state.Scratch): the cache's buffers for kernels that write in place.

        Returns:
            mx.array | None: (1, n_q_heads, L, head_dim) in the queries' dtype, or None (the portable path
            answers this call).
        """
        return None


def on_gpu():
    """True if MLX's default device is a GPU."""
    return mx.default_device() != mx.cpu
