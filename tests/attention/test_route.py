"""attention/route: mlx-lm's attention reaches the cartridge route whatever the import order (issue 32.6).

Model files bind `scaled_dot_product_attention` at their import (`from .base import ...`), so a family
module imported after a cartridge was loaded must still bind the routed function, and a model file of
one's own that imported mlx-lm's original before any load must be rebound. The check runs in a fresh
interpreter: in this test session other tests may already have imported every family.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

OWN_FAMILY = "from mlx_lm.models.base import scaled_dot_product_attention\n"  # a user's model file

LATE_IMPORT = textwrap.dedent("""
    import json, sys, tempfile
    import cartridge  # first: loads OpenBLAS before mlx
    import own_family  # imported before any install: it holds mlx-lm's original
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from helpers.tiny_models import make_tiny
    from helpers.family_models import make_model
    from cartridge.attention import route
    from cartridge.models.gguf import tokenizer_from_metadata
    from cartridge.models.loader import default_gguf_path

    tokenizer = tokenizer_from_metadata(mx.load(str(default_gguf_path()), return_metadata=True)[1])
    tiny = make_tiny(tokenizer)
    with tempfile.TemporaryDirectory() as folder:
        cartridge.build("A short document about leases. " * 8, folder + "/doc.cart", model=tiny)
        cart = cartridge.load(folder + "/doc.cart", model=tiny)
        cart.prompt_cache()
    before = "mlx_lm.models.qwen2" in sys.modules
    late = make_model("qwen2", tokenizer)  # imports mlx_lm.models.qwen2 now, after the load
    module = sys.modules["mlx_lm.models.qwen2"]
    calls = []
    with route.watching(lambda q, k, v, cache, mask: calls.append(q.shape)):
        late.model(mx.array([[1, 2, 3]]), cache=make_prompt_cache(late.model))
    print(json.dumps({"imported_before_load": before, "layers": len(late.model.layers), "routed_calls": len(calls),
                      "bound_routed": module.scaled_dot_product_attention is route.scaled_dot_product_attention,
                      "own_routed": own_family.scaled_dot_product_attention is route.scaled_dot_product_attention,
                      "original_kept": route._ORIGINAL.__module__}))
""")


def test_family_imported_after_a_load_is_routed(tmp_path):
    (tmp_path / "own_family.py").write_text(OWN_FAMILY)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(tmp_path)])}
    done = subprocess.run([sys.executable, "-c", LATE_IMPORT], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"imported_before_load": False, "layers": 4, "routed_calls": 4, "bound_routed": True,
                      "own_routed": True, "original_kept": "mlx_lm.models.base"}


def test_install_twice_keeps_mlx_lm_original():
    from mlx_lm.models import base, llama

    from cartridge.attention import route

    route.install()
    route.install()
    assert base.scaled_dot_product_attention is route.scaled_dot_product_attention
    assert llama.scaled_dot_product_attention is route.scaled_dot_product_attention
    assert route._ORIGINAL is not route.scaled_dot_product_attention
    assert route._ORIGINAL.__module__ == "mlx_lm.models.base"
