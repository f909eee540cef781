"""The "llm" section of a snapshot's manifest: its wire format, and the checks a restore runs on
it before any stage uses a value from it.

    {
      "model_content_hash": "<64 hex>",        # snapshot_files.model_content_hash of the model
      "source_model_dir": "/models/llama" | null,  # the folder the init read (a fallback's
      "source_embedded": false,                # candidate, verified by the content hash);
                                               # true: the embedded default model
      "model_type": "llama",                   # model/config.json's
      "init_config": {...},                    # the InitConfig the plan was made with
      "memory_plan": {"num_pages", "page_size", "bytes_per_page", "kv_bytes", "weights_bytes",
                      "peak_activation_bytes", "total_bytes", "mem_fraction_static", "source"},
      "graph_buckets": [1, 2, 4, ...],         # captured at init (for `inspect`)
      "layout": "<the restore layout's table, as JSON text>",   # layout/table.py
      "health": {"prompt_ids": [...], "token": 42, "logprob": -0.01},
      "compile_caches": {...},                 # what caches/ holds (for `inspect`)
      "kernel_choices": [{"kernel": "_gemv_kernel", "key": "(4096, ...)",  # each autotuned
                          "config": "BLOCK_K=512,BLOCK_N=8,w4,s3", "source": "shipped"}, ...],
                                               # kernel's config per key at init (CUDA; pinned
                                               # by a restore: kernels/triton/tuning.py)
      "prefix_warm": ["You are a helpful assistant. ...", ...],  # prompts a restore prefills
                                               # into the prefix cache (prefix_warm.py)
      "grammars": [{"kind": "json_schema", "text": "{...}"}, ...],  # structured-output specs
                                               # compiled at init, compiled again at restore
      "parallel": {"tp_size": 2, "ep_size": 1, "ep_dispatch": "replicated"},  # several ranks:
      "ranks": [{"layout": "...", "memory_plan": {...}}, ...]  # rank K's, weights/rankK.bin
    }

With several ranks, `check_section` checks the rank it is asked for: its layout against its
weights file and its plan, as rank 0's are checked without them; the rank layout recorded in
"parallel" must be the restore's (another split of the same number of ranks is refused).

`check_section` (the validate stage, before the model is built): the types and ranges of every
field a restore reads; the layout's table against the weights file the manifest lists (the
same size, chunking and digests, and a valid table); the memory plan against that table (its
weights bytes), against itself (`kv_bytes = num_pages × bytes_per_page`), against the
`init_config` it was made with (on CPU the page count its KV budget gives; on CUDA its memory
fraction, and pages that fit the GPU memory it records beside the weights and the activations'
peak) and against the configuration this restore runs with (the same page size, which the
scheduler uses; speculation on in both or in neither, since its pages hold the MTP layers'
cache or not; a pool no larger than its KV budget on CPU; a memory fraction no larger than its
own on CUDA) — an edited plan, or one that would not fit, is refused instead of served or
OOM-killed.
`check_against_model` (once the model is built from the snapshot's config): the model type,
the plan's bytes per page and weights bytes, on CUDA this GPU's memory (the plan's total), and
the health record's token ids inside the vocabulary. `kernel_choices` is shape-checked here;
a choice naming a config its kernel does not declare is refused when the kernel first runs.
`grammars` (absent: none) is shape-checked here (a list of at most `MAX_GRAMMARS` specs, each
exactly {"kind", "text"} of a known kind); a spec that does not compile fails the restore's
`grammars` stage. Each refusal is a BadSnapshot with a one-line reason; the runtime falls back.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from snapfn.handler.llm.recipes.prefix_warm import check_warm_prompts
from snapfn.snapshot.errors import BadSnapshot, one_line

WEIGHTS_FILE = "weights/rank0.bin"
PLAN_SOURCES = ("profiled", "fixed budget")
MAX_PROMPT_IDS = 1 << 16
MAX_GRAMMARS = 1024  # structured/configured.py's MAX_CONFIGURED
_HEX64 = re.compile(r"[0-9a-f]{64}")
_INT_FIELDS = (
    "num_pages",
    "page_size",
    "bytes_per_page",
    "kv_bytes",
    "weights_bytes",
    "peak_activation_bytes",
    "total_bytes",
)


@dataclass(frozen=True)
class CheckedSection:
    """What a restore reads of the section, each value checked."""

    layout: Any  # RestoreLayout, validated against the weights file
    plan: dict[str, Any]  # MemoryPlan's fields
    health: dict[str, Any]
    model_type: str
    content_hash: str
    kernel_choices: list[dict[str, str]]  # tuning.parse_choices'd; [] where none were recorded
    grammars: list[Any] = ()  # structured.spec.GrammarSpec each; none recorded: []
    prefix_warm: list[str] = ()  # prompts to warm the prefix cache with (prefix_warm.py)


def check_section(
    section: dict[str, Any],
    files: dict[str, Any],
    config: Any,
    rank: int = 0,
    parallel: dict[str, Any] | None = None,
) -> CheckedSection:
    """The section's fields a restore uses, checked (see the module docstring), those of
    `rank` of a restore laid out as `parallel` (None: one rank); BadSnapshot."""
    content_hash = section.get("model_content_hash")
    if not isinstance(content_hash, str) or not _HEX64.fullmatch(content_hash):
        raise _refuse(f"model_content_hash {content_hash!r:.80} is not 64 lowercase hex digits")
    model_type = section.get("model_type")
    if not isinstance(model_type, str) or not 0 < len(model_type) <= 64:
        raise _refuse(f"model_type {model_type!r:.80} is not a model type")
    entry = _rank_entry(section, rank, parallel)
    layout = _checked_layout(entry.get("layout"), files, f"weights/rank{rank}.bin")
    plan = _checked_plan(entry.get("memory_plan"), layout, section.get("init_config"), config)
    health = _checked_health(section.get("health"))
    choices = _checked_choices(section.get("kernel_choices", []))
    grammars = _checked_grammars(section.get("grammars", []))
    warm = check_warm_prompts(section.get("prefix_warm", []))
    return CheckedSection(layout, plan, health, model_type, content_hash, choices, grammars, warm)


def _checked_grammars(value: Any) -> list[Any]:
    from snapfn.handler.llm.structured.spec import GrammarSpec
    from snapfn.snapshot.errors import BadRequest

    if not isinstance(value, list) or len(value) > MAX_GRAMMARS:
        raise _refuse(f"grammars is not a list of at most {MAX_GRAMMARS} grammar specs")
    specs = []
    for k, entry in enumerate(value):
        try:
            specs.append(GrammarSpec.from_json(entry))
        except BadRequest as exc:
            raise _refuse(f"grammars[{k}] is not a grammar spec: {exc}") from None
    return specs


def _checked_choices(value: Any) -> list[dict[str, str]]:
    from snapfn.handler.llm.kernels.triton.tuning import parse_choices

    try:
        return parse_choices(value)
    except BadSnapshot as exc:
        raise _refuse(str(exc)) from None


_LAYER = re.compile(r"model\.layers\.(\d{1,9})\.")


def check_config_against_layout(model_config: Any, tensors: dict[str, Any], parallel: Any) -> None:
    """The snapshot's model/config.json against its checked layout table, before any model is
    built from it: as many layers as the weights hold, and an embedding of
    the hidden size and this rank's rows of the vocabulary. NOTE: a config.json naming 20000
    layers, or a vast vocabulary, would otherwise be built (seconds to hours of allocation)
    before `check_against_model` refused it."""
    from snapfn.handler.llm.models.tensor_parallel import vocab_rows

    # NOTE: MTP layers are `mtp.{j}.…` in a layout (`as_held` counted them already)
    held = len({m.group(1) for name in tensors if (m := _LAYER.match(name))})
    wanted = model_config.num_layers
    if held != wanted:
        raise _refuse(f"its model/config.json builds {wanted} layers, the weights hold {held}")
    embedding = tensors.get("model.embed_tokens.weight")
    shape = list(getattr(embedding, "shape", ()))
    rows = vocab_rows(model_config.vocab_size, parallel)[1]
    if shape != [rows, model_config.hidden_size]:
        raise _refuse(
            f"its model/config.json makes an embedding of {[rows, model_config.hidden_size]}, "
            f"the weights hold {shape}"
        )


def check_against_model(checked: CheckedSection, model_config: Any, model: Any) -> None:
    """The section against the model built from the snapshot's model/config.json."""
    from snapfn.handler.llm.engine.kv_pool import bytes_per_page
    from snapfn.handler.llm.engine.memory import weights_bytes

    if model_config.model_type != checked.model_type:
        raise _refuse(
            f"model_type is {checked.model_type!r}, its model/config.json says "
            f"{model_config.model_type!r}"
        )
    plan = checked.plan
    per_page = bytes_per_page(model.kv_buffer_specs(), plan["page_size"], model.dtype)
    if plan["bytes_per_page"] != per_page:
        raise _refuse(
            f"memory_plan bytes_per_page is {plan['bytes_per_page']}, the model's pages take "
            f"{per_page}"
        )
    if plan["weights_bytes"] != weights_bytes(model):
        raise _refuse(
            f"memory_plan weights_bytes is {plan['weights_bytes']}, the model holds "
            f"{weights_bytes(model)}"
        )
    if model.device.type == "cuda":
        import torch

        total = torch.cuda.mem_get_info(model.device)[1]
        if plan["total_bytes"] != total:
            raise _refuse(
                f"memory_plan was profiled on a GPU of {plan['total_bytes']} bytes, this one "
                f"has {total}"
            )
    ids = [*checked.health["prompt_ids"], checked.health["token"]]
    if max(ids) >= model_config.vocab_size:
        raise _refuse(
            f"health record token id {max(ids)} is outside the model's {model_config.vocab_size}"
            "-token vocabulary"
        )


def _rank_entry(section: dict[str, Any], rank: int, parallel: dict[str, Any] | None) -> dict:
    """Where rank `rank`'s layout and plan are: the section itself for one rank, else its
    entry of "ranks", once the recorded rank layout is the restore's."""
    one = {"tp_size": 1, "ep_size": 1, "ep_dispatch": "replicated"}
    recorded, wanted = section.get("parallel", one), parallel or one
    if not isinstance(recorded, dict) or set(recorded) != set(one):
        raise _refuse(f"parallel {recorded!r:.120} is not a rank layout")
    if recorded != wanted:
        split = lambda p: f"tp {p['tp_size']} x ep {p['ep_size']} ({p['ep_dispatch']})"  # noqa: E731
        raise _refuse(f"made for {split(recorded)}, this restore runs {split(wanted)}")
    world = recorded["tp_size"] * recorded["ep_size"]
    if world == 1:
        return section
    ranks = section.get("ranks")
    if (
        not isinstance(ranks, list)
        or len(ranks) != world
        or not all(isinstance(r, dict) for r in ranks)
    ):
        raise _refuse(f"ranks is not a list of {world} rank entries")
    return ranks[rank]


def _checked_layout(text: Any, files: dict[str, Any], weights_file: str = WEIGHTS_FILE) -> Any:
    from snapfn.snapshot.layout.table import RestoreLayout

    if not isinstance(text, str):
        raise _refuse("layout is not a restore layout table (JSON text)")
    entry = files.get(weights_file)
    if entry is None:
        raise _refuse(f"{weights_file} is not listed")
    try:
        layout = RestoreLayout.from_json(text)
        layout.validate(entry["size"])
    except BadSnapshot as exc:
        raise _refuse(str(exc)) from None
    if entry.get("chunk_bytes") != layout.chunk_bytes or entry.get("chunks") != layout.chunk_sha256:
        raise _refuse(f"the restore layout's chunk digests are not those listed for {weights_file}")
    if entry.get("sha256") not in (None, layout.file_sha256):
        raise _refuse(f"the restore layout's file sha256 is not the one listed for {weights_file}")
    return layout


def _checked_plan(plan: Any, layout: Any, made_with: Any, config: Any) -> dict[str, Any]:
    if not isinstance(plan, dict):
        raise _refuse("memory_plan is not a JSON object")
    expected = {*_INT_FIELDS, "mem_fraction_static", "source"}
    if set(plan) != expected:
        odd = sorted(set(plan) ^ expected)
        raise _refuse(f"memory_plan fields differ from a memory plan's ({', '.join(odd)[:120]})")
    for name in _INT_FIELDS:
        value = plan[name]
        if type(value) is not int or not 0 <= value < 1 << 62:
            raise _refuse(f"memory_plan {name} {value!r:.40} is not a byte or page count")
    fraction = plan["mem_fraction_static"]
    if type(fraction) not in (int, float) or not 0.0 <= fraction <= 1.0:
        raise _refuse(f"memory_plan mem_fraction_static {fraction!r:.40} is not in [0, 1]")
    if plan["source"] not in PLAN_SOURCES:
        raise _refuse(f"memory_plan source {plan['source']!r:.40} is not one of {PLAN_SOURCES}")
    _check_plan_sums(plan, layout)
    made_with = _checked_init_config(made_with, plan)
    if plan["page_size"] != config.page_size:
        raise _refuse(
            f"memory_plan page_size is {plan['page_size']}, this configuration's is "
            f"{config.page_size}"
        )
    made_k = made_with.get("speculative_tokens") or 0
    if bool(made_k) != bool(config.speculative_tokens):  # the MTP layers' KV in a page, or not
        fix = "0" if not made_k else "1 to 8"
        raise _refuse(
            f"it was made with speculative_tokens={made_k!r:.20} (its KV pages "
            f"{'hold' if made_k else 'leave out'} the MTP layers' cache), this configuration "
            f"asks for {config.speculative_tokens}: set SNAPFN_SPECULATIVE_TOKENS to {fix}, or "
            "make the snapshot again"
        )
    if config.device.startswith("cuda"):
        _check_profiled_plan(plan, made_with, config)
    else:
        _check_fixed_plan(plan, made_with, config)
    return dict(plan)


def _checked_init_config(made_with: Any, plan: dict[str, Any]) -> dict[str, Any]:
    """The init_config the plan was made with: the fields a plan follows from, as the plan."""
    if not isinstance(made_with, dict):
        raise _refuse("init_config is not a JSON object")
    budget, fraction = made_with.get("kv_cache_bytes_cpu"), made_with.get("mem_fraction_static")
    if type(budget) is not int or not 0 <= budget < 1 << 62:
        raise _refuse(f"init_config kv_cache_bytes_cpu {budget!r:.40} is not a byte count")
    if type(fraction) not in (int, float) or not 0.0 <= fraction <= 1.0:
        raise _refuse(f"init_config mem_fraction_static {fraction!r:.40} is not in [0, 1]")
    if made_with.get("page_size") != plan["page_size"]:
        raise _refuse(
            f"memory_plan page_size is {plan['page_size']}, its init_config's is "
            f"{made_with.get('page_size')!r:.40}"
        )
    return made_with


def _check_plan_sums(plan: dict[str, Any], layout: Any) -> None:
    if plan["num_pages"] < 1 or plan["page_size"] < 1 or plan["bytes_per_page"] < 1:
        raise _refuse("memory_plan has no pages, or pages of no size")
    if plan["kv_bytes"] != plan["num_pages"] * plan["bytes_per_page"]:
        raise _refuse(
            f"memory_plan kv_bytes {plan['kv_bytes']} is not num_pages {plan['num_pages']} x "
            f"bytes_per_page {plan['bytes_per_page']}"
        )
    tensor_bytes = sum(e.nbytes for e in layout.tensors.values())
    if plan["weights_bytes"] != tensor_bytes:
        raise _refuse(
            f"memory_plan weights_bytes {plan['weights_bytes']} is not the {tensor_bytes} "
            "bytes of the restore layout's tensors"
        )


def _check_fixed_plan(plan: dict[str, Any], made_with: dict[str, Any], config: Any) -> None:
    """On CPU the pool is a fixed byte budget: the plan is what the budget it was made with
    gives, and no larger than this configuration's."""
    if plan["source"] != "fixed budget":
        raise _refuse(f"memory_plan is {plan['source']!r}, a CPU restore needs a fixed budget")
    profiled = [plan["peak_activation_bytes"], plan["total_bytes"], plan["mem_fraction_static"]]
    if profiled != [0, 0, 0.0]:
        raise _refuse(f"memory_plan records a profile {profiled} on a CPU fixed budget")
    budget = made_with["kv_cache_bytes_cpu"]
    pages = max(1, budget // plan["bytes_per_page"])
    if plan["num_pages"] != pages:
        raise _refuse(
            f"memory_plan has {plan['num_pages']} pages, the KV budget of {budget} bytes it "
            f"was made with gives {pages}"
        )
    allowed = max(config.kv_cache_bytes_cpu, plan["bytes_per_page"])
    if plan["kv_bytes"] > allowed:
        raise _refuse(
            f"memory_plan's KV pool of {plan['kv_bytes']} bytes is more than this "
            f"configuration's budget of {config.kv_cache_bytes_cpu}"
        )


def _check_profiled_plan(plan: dict[str, Any], made_with: dict[str, Any], config: Any) -> None:
    """On CUDA the plan was profiled: for the memory fraction it was made with, at most this
    configuration's, its pages must fit beside the weights and the activations' peak in the
    GPU memory it records (`check_against_model` checks that this GPU has that much)."""
    if plan["source"] != "profiled":
        raise _refuse(f"memory_plan is {plan['source']!r}, a CUDA restore needs a profiled one")
    fraction = plan["mem_fraction_static"]
    if not math.isclose(fraction, made_with["mem_fraction_static"]):
        raise _refuse(
            f"memory_plan mem_fraction_static is {fraction}, its init_config's is "
            f"{made_with['mem_fraction_static']}"
        )
    if fraction > config.mem_fraction_static + 1e-9:
        raise _refuse(
            f"memory_plan was made for mem_fraction_static {fraction}, more than this "
            f"configuration's {config.mem_fraction_static}"
        )
    room = int(plan["total_bytes"] * fraction) - plan["weights_bytes"]
    if plan["num_pages"] < 2 or plan["kv_bytes"] + plan["peak_activation_bytes"] > room:
        raise _refuse(
            f"memory_plan's {plan['num_pages']} pages ({plan['kv_bytes']} bytes) and "
            f"{plan['peak_activation_bytes']} bytes of activations do not fit the {room} bytes "
            "its GPU has beside the weights"
        )


def _checked_health(health: Any) -> dict[str, Any]:
    if not isinstance(health, dict):
        raise _refuse("health is not a JSON object")
    ids, token, logprob = health.get("prompt_ids"), health.get("token"), health.get("logprob")
    if (
        not isinstance(ids, list)
        or not 0 < len(ids) <= MAX_PROMPT_IDS
        or not all(type(i) is int and i >= 0 for i in ids)
    ):
        raise _refuse("health prompt_ids is not a list of token ids")
    if type(token) is not int or token < 0:
        raise _refuse(f"health token {token!r:.40} is not a token id")
    if type(logprob) not in (int, float) or not -math.inf < logprob <= 0.0:
        raise _refuse(f"health logprob {logprob!r:.40} is not a finite log probability")
    return {"prompt_ids": list(ids), "token": token, "logprob": logprob}


def _refuse(reason: str) -> BadSnapshot:
    return BadSnapshot(one_line(f"its llm section: {reason}"))
