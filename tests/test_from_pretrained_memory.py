"""``AttnOnlyTransformer.from_pretrained`` holds no second copy of the weights (issue 12, item 5).

TransformerLens's loader is mocked (no hub): it returns a state dict that exists before the call.
A child process (glibc's mmap threshold fixed, so every tensor is its own mapping and freed memory
leaves the resident set) measures the peak resident memory each way of getting a model adds:

- ``HookedTransformer.from_pretrained``: TransformerLens's own load, the reference;
- ``AttnOnlyTransformer.from_pretrained``: must add no more than the reference, with and without
  TransformerLens's weight processing (which clones the state dict: 2 models' worth for both);
- ``convert(HookedTransformer.from_pretrained(...))``: holds two models, a second copy; it shows
  that the measurement sees one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = r"""
import gc, json, sys, warnings
import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig
import tl_attnonly.hub
from tl_attnonly import AttnOnlyTransformer, convert

warnings.filterwarnings("ignore")
ht_module = sys.modules["transformer_lens.HookedTransformer"]
torch.set_num_threads(1)


def config(fold_ln=False, dtype=torch.float32, **kwargs):
    return HookedTransformerConfig(
        n_layers=4, d_model=384, n_heads=6, d_head=64, d_mlp=1536, d_vocab=1000, n_ctx=64,
        act_fn="gelu_new", normalization_type="LNPre" if fold_ln else "LN", dtype=dtype,
        device="cpu", init_weights=False, original_architecture="GPT2LMHeadModel",
    )


source = HookedTransformer(config(), move_to_device=False)
with torch.no_grad():
    for p in source.parameters():
        p.normal_(0, 0.02)
STATE = source.state_dict()
del source
MODEL_BYTES = sum(t.numel() * t.element_size() for t in STATE.values())
ht_module.loading.get_official_model_name = lambda name: name
tl_attnonly.hub.hub_unreachable = lambda timeout=0: None  # TL's loading is faked: no hub check
ht_module.loading.get_pretrained_model_config = lambda name, **kw: config(**kw)
# A new dict each call (TL deletes its keys while loading) of tensors made before the call.
ht_module.loading.get_pretrained_state_dict = lambda *a, **k: dict(STATE)


def status(field):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1]) * 1024


def added_peak(make):
    gc.collect()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # the high-water mark becomes the current resident size
    base = status("VmRSS")
    model = make()
    peak = status("VmHWM")
    del model
    gc.collect()
    return (peak - base) / MODEL_BYTES


KW = dict(device="cpu", fold_ln=False, center_writing_weights=False, center_unembed=False,
          fold_value_biases=False)
ways = {
    "tl": lambda: HookedTransformer.from_pretrained("fake", **KW),
    "attn_only": lambda: AttnOnlyTransformer.from_pretrained("fake", **KW),
    "convert_after_tl": lambda: convert(HookedTransformer.from_pretrained("fake", **KW)),
    # with TL's weight processing (fold_ln, centring: new tensors, the same for both classes)
    "tl_processed": lambda: HookedTransformer.from_pretrained("fake", device="cpu"),
    "attn_only_processed": lambda: AttnOnlyTransformer.from_pretrained("fake", device="cpu"),
}
for make in ways.values():  # warm up: one-off allocations are not the models'
    make()
result = {name: added_peak(make) for name, make in ways.items()}
check = AttnOnlyTransformer.from_pretrained("fake", **KW)
result["same_weights"] = all(
    torch.equal(check.state_dict()[k], v) for k, v in STATE.items()
)
result["model_bytes"] = MODEL_BYTES
print(json.dumps(result))
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.access("/proc/self/clear_refs", os.W_OK),
    reason="measures the resident set through Linux's /proc/self/{status,clear_refs}",
)
def test_from_pretrained_holds_one_copy_of_the_weights():
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    root = Path(__file__).resolve().parents[1]
    child = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    peaks = json.loads(child.stdout.strip().splitlines()[-1])
    assert peaks["same_weights"]
    # TL's own load adds one model (its parameters; the state dict existed before the call).
    assert 0.9 < peaks["tl"] < 1.2, peaks
    # The converted class, built by TL's loader: the same. (Before the neuron-head layers took
    # the MLPs' own tensors, building them wrote every MLP weight once more: +0.6 here, processed.)
    assert peaks["attn_only"] < peaks["tl"] + 0.1, peaks
    assert peaks["attn_only_processed"] < peaks["tl_processed"] + 0.1, peaks
    # Loading, then converting, holds a second copy: the measurement would see one.
    assert peaks["convert_after_tl"] > peaks["tl"] + 0.7, peaks
