"""Export helpers (tl_attnonly.vis.export): text that is safe inside <script>."""

from __future__ import annotations

from tl_attnonly.vis import circuitsvis_js, script_safe, script_safe_json


def test_script_safe_cannot_close_the_script_element():
    js = 'var s = "</script><script>alert(1)</script>";'
    safe = script_safe(js)
    assert "</script" not in safe
    assert safe == 'var s = "<\\/script><script>alert(1)<\\/script>";'  # same string in JS


def test_the_inlined_bundles_and_props_are_script_safe():
    assert "</script" not in circuitsvis_js()
    text = script_safe_json({"tokens": ["</script>", "a & b"]})
    assert "<" not in text and ">" not in text and "&" not in text
