"""What every attention backend says about itself (`cartridge.attention.backends` lists them)."""

import mlx.core as mx

MODES = ("decode", "prefill")  # decode: at most 8 query rows per KV head; prefill: a question over the prefix


class AttentionBackend:
    """One way decode steps read a layer's prefix pages; subclass it and add one line to the registry.

    Two kinds of entry share this class:

    - a device entry (`default_policy` set): names the device it runs on ("cpu", "cuda", "metal") and the
      policy `auto` takes there where the measured table has no case;
    - a kernel entry (`policy` set): the layers it reads (`supports`) and the callable it builds (`build`);
      `None` from `build` (or from the callable) means the portable path.

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
        """The layer's attention, built once: callable(cache, queries, scale, sinks) -> (1, n_q_heads, L, D)
        in the queries' dtype, or None (the portable path for that call); None here: the portable path always."""
        return None


def on_gpu():
    """True if MLX's default device is a GPU."""
    return mx.default_device() != mx.cpu
