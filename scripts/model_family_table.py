"""Which of TransformerLens's official models convert exactly, approximately, or are refused.

Derived offline from TransformerLens's own code, never by hand:

1. The names: ``transformer_lens.supported_models.OFFICIAL_MODEL_NAMES``.
2. Each name's HF architecture: the name rules at the top of TL's ``convert_hf_model_config``
   (LLaMA, Gemma), else TL's model registry ``tools/model_registry/data/supported_models.json``
   (TL otherwise asks the Hugging Face hub: those names are listed as "architecture unknown
   offline").
3. Each name's MLP: the ``if/elif`` branch of ``convert_hf_model_config`` that TL would take for
   that name and architecture (its tests are evaluated; its ``cfg_dict`` literal is read with
   ``ast``): ``act_fn``, ``gated_mlp``, ``num_experts``. Where TL reads ``act_fn`` from the hub
   config (``hf_config.hidden_act``), the activation is "unknown offline".
4. The verdict: :func:`tl_attnonly.options.check_convertible` on a small config with those fields
   (so the table follows the package's own refusals), then "exact" for ``silu`` (SwiGLU, SiLU),
   "approximate" for the GELU family and ReLU (bounds in the README), "refused" with the reason;
   "by hub act_fn" where only the activation is unknown offline (exact if it is ``silu``,
   approximate for GELU/ReLU).
   NeelNanda/ArthurConmy/Baidicoot models use TL's separate ``convert_neel_model_config`` (hub);
   encoders/encoder-decoders are not ``HookedTransformer`` models.

Usage: ``python scripts/model_family_table.py [--per-model]`` prints Markdown.
"""

from __future__ import annotations

import argparse
import ast
import collections
import inspect
import json
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import transformer_lens
import transformer_lens.loading_from_pretrained as lfp
from transformer_lens import HookedTransformerConfig
from transformer_lens.supported_models import OFFICIAL_MODEL_NAMES

from tl_attnonly.activations import GELU_VARIANTS
from tl_attnonly.options import ConversionOptions, check_convertible

REGISTRY = (
    Path(transformer_lens.__file__).parent / "tools/model_registry/data/supported_models.json"
)
NOT_DECODERS = {
    "BertForMaskedLM": "encoder (use convert_encoder)",
    "T5ForConditionalGeneration": "encoder-decoder (not a HookedTransformer)",
    "HubertModel": "audio encoder (not a HookedTransformer)",
    "HubertForCTC": "audio encoder (not a HookedTransformer)",
}


def registry_architectures() -> dict[str, str]:
    """model id -> architecture, from TL's model registry."""
    data = json.loads(REGISTRY.read_text())
    return {m["model_id"]: m["architecture_id"] for m in data["models"]}


def _function_body() -> list[ast.stmt]:
    source = textwrap.dedent(inspect.getsource(lfp.convert_hf_model_config))
    fn = ast.parse(source).body[0]
    assert isinstance(fn, ast.FunctionDef)
    return fn.body


def _architecture_rule(body: list[ast.stmt]) -> ast.If:
    """TL's first if-chain: name rules for LLaMA/Gemma, else ``AutoConfig`` (the hub)."""
    return next(s for s in body if isinstance(s, ast.If) and "architecture" in ast.unparse(s))


def _config_branches(body: list[ast.stmt]) -> list[tuple[ast.expr, ast.Dict | None]]:
    """The ``if/elif`` chain that builds ``cfg_dict``: (test, its dict literal) per branch."""
    chain = next(
        s for s in body if isinstance(s, ast.If) and "cfg_dict = {" in ast.unparse(s)[:2000]
    )
    out: list[tuple[ast.expr, ast.Dict | None]] = []
    node: ast.If | None = chain
    while node is not None:
        literal = next(
            (n for n in ast.walk(ast.Module(node.body, [])) if isinstance(n, ast.Dict)), None
        )
        out.append((node.test, literal))
        node = (
            node.orelse[0] if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If) else None
        )
    return out


def _fields(literal: ast.Dict | None) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if literal is None:
        return fields
    for key, value in zip(literal.keys, literal.values):
        if isinstance(key, ast.Constant) and key.value in ("act_fn", "gated_mlp", "num_experts"):
            try:
                fields[key.value] = ast.literal_eval(value)
            except ValueError:
                fields[key.value] = "?" + ast.unparse(value)
    return fields


class _HubStub:
    """Stands in for ``AutoConfig``: answers ``architectures`` from TL's registry, offline."""

    def __init__(self, registry: dict[str, str]):
        self.registry = registry

    def from_pretrained(self, name: str, **_: Any) -> SimpleNamespace:
        if name not in self.registry:
            raise LookupError(name)
        return SimpleNamespace(architectures=[self.registry[name]])


def model_rows() -> list[dict[str, Any]]:
    body = _function_body()
    rule = ast.Module([_architecture_rule(body)], [])
    branches = _config_branches(body)
    hub = _HubStub(registry_architectures())
    rows = []
    for name in OFFICIAL_MODEL_NAMES:
        row: dict[str, Any] = {"model": name}
        if name.startswith(("NeelNanda", "ArthurConmy", "Baidicoot")):
            row.update(architecture="(TL's own models)", verdict="unknown offline",
                       reason="config from the hub (convert_neel_model_config)")  # fmt: skip
            rows.append(row)
            continue
        scope: dict[str, Any] = dict(
            official_model_name=name, AutoConfig=hub, het_safe_view=lambda c: c,
            os=SimpleNamespace(environ={}), kwargs={},
        )  # fmt: skip
        try:
            exec(compile(rule, "<tl-architecture-rule>", "exec"), scope)  # noqa: S102
        except LookupError:
            row.update(architecture="?", verdict="unknown offline",
                       reason="architecture from the hub (not in TL's registry)")  # fmt: skip
            rows.append(row)
            continue
        arch = scope["architecture"]
        row["architecture"] = arch
        fields: dict[str, Any] = {}
        for test, literal in branches:
            try:
                taken = eval(  # noqa: S307
                    compile(ast.Expression(test), "<tl-branch>", "eval"),
                    {"official_model_name": name, "architecture": arch},
                )
            except Exception:  # a test reading the hub config: not this branch offline
                continue
            if taken:
                fields = _fields(literal)
                break
        row.update(fields)
        row.update(verdict(arch, fields))
        rows.append(row)
    return rows


def verdict(arch: str, fields: dict[str, Any]) -> dict[str, str]:
    if arch in NOT_DECODERS:
        return {"verdict": "not a decoder", "reason": NOT_DECODERS[arch]}
    act_fn = fields.get("act_fn")
    act_known = act_fn is not None and not str(act_fn).startswith("?")
    moe = "num_experts" in fields  # TL's code sets it (a literal or from the hub config)
    cfg = HookedTransformerConfig(
        n_layers=1, d_model=8, n_ctx=8, d_head=4, d_mlp=8,
        act_fn=act_fn if act_known else "silu",
        gated_mlp=bool(fields.get("gated_mlp", False)),
        num_experts=2 if moe else None, experts_per_token=1 if moe else None,
        original_architecture=arch,
    )  # fmt: skip
    try:
        check_convertible(cfg, ConversionOptions(), form="structured")
    except (ValueError, NotImplementedError) as err:
        return {"verdict": "refused", "reason": str(err).split(":")[0]}
    kind = "MoE" if moe else ("gated" if fields.get("gated_mlp") else "dense")
    if not act_known:
        return {
            "verdict": "by hub act_fn",
            "reason": f"{kind}; act_fn is the hub's {str(act_fn or '?').lstrip('?')}",
        }
    if act_fn == "silu":
        return {"verdict": "exact", "reason": f"{kind} silu"}
    if act_fn in GELU_VARIANTS or act_fn == "relu":
        return {"verdict": "approximate", "reason": f"{kind} {act_fn}"}
    return {"verdict": "refused", "reason": f"{kind} {act_fn}"}


def family_table(rows: list[dict[str, Any]]) -> str:
    groups: dict[tuple[str, str, str], list[str]] = collections.defaultdict(list)
    for row in rows:
        groups[(row["verdict"], row.get("architecture", "?"), row["reason"])].append(row["model"])
    order = {
        "exact": 0,
        "by hub act_fn": 1,
        "approximate": 2,
        "refused": 3,
        "not a decoder": 4,
        "unknown offline": 5,
    }
    lines = [
        "| verdict | architecture | MLP / reason | models | examples |",
        "|---|---|---|---|---|",
    ]
    for (v, arch, reason), names in sorted(
        groups.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])
    ):
        examples = ", ".join(f"`{n}`" for n in names[:2])
        lines.append(f"| {v} | {arch} | {reason} | {len(names)} | {examples} |")
    counts = collections.Counter(row["verdict"] for row in rows)
    total = ", ".join(f"{v}: {counts[v]}" for v in sorted(counts, key=order.__getitem__))
    lines.append("")
    lines.append(f"{len(rows)} official model names ({total}).")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-model", action="store_true", help="one row per model name")
    args = parser.parse_args()
    rows = model_rows()
    if args.per_model:
        print("| model | architecture | verdict | reason |\n|---|---|---|---|")
        for row in rows:
            print(f"| `{row['model']}` | {row.get('architecture', '?')} | {row['verdict']} | "
                  f"{row['reason']} |")  # fmt: skip
    else:
        print(family_table(rows))


if __name__ == "__main__":
    main()
