"""InitConfig from the environment: each field's SNAPFN_ variable parsed by its type, a value
that does not parse refused naming the variable, and `to_env` read back to an equal config."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapfn.handler.llm.init_config import InitConfig
from snapfn.snapshot.errors import BadRequest


def test_each_kind_of_field_is_read_from_its_variable():
    config = InitConfig.from_env(
        {
            "SNAPFN_GRAPH_MAX_BATCH": "8",
            "SNAPFN_MEM_FRACTION_STATIC": "0.5",
            "SNAPFN_OVERLAP_SPECULATIVE": "off",
            "SNAPFN_PREFIX_CACHING": "Yes",
            "SNAPFN_PREFILL_CHUNK_SIZES": "512, 2048",
            "SNAPFN_CACHE_DIR": "/tmp/snapfn-c",
        }
    )
    assert config.graph_max_batch == 8 and config.mem_fraction_static == 0.5
    assert config.overlap_speculative is False and config.prefix_caching is True
    assert config.prefill_chunk_sizes == (512, 2048) and config.cache_dir == Path("/tmp/snapfn-c")


@pytest.mark.parametrize(
    ("variable", "raw", "says"),
    [
        ("SNAPFN_GRAPH_MAX_BATCH", "lots", "expected an integer"),
        ("SNAPFN_MEM_FRACTION_STATIC", "most", "expected a number"),
        ("SNAPFN_OVERLAP_SPECULATIVE", "maybe", "expected one of 0, 1, false, no, off, on"),
        ("SNAPFN_PREFILL_CHUNK_SIZES", "512,x", "expected integers separated by commas"),
        # parsed, but out of range
        ("SNAPFN_PAGE_SIZE", "0", "page_size (SNAPFN_PAGE_SIZE) must be at least 1, got 0"),
        ("SNAPFN_MAX_MODEL_LEN", "-5", "(SNAPFN_MAX_MODEL_LEN) must be at least 2, got -5"),
        ("SNAPFN_SPECULATIVE_TOKENS", "-1", "(SNAPFN_SPECULATIVE_TOKENS) must be at least 0"),
        ("SNAPFN_MEM_FRACTION_STATIC", "1.5", "must be in (0, 1], got 1.5"),
        ("SNAPFN_PREFILL_CHUNK_SIZES", "512,0", "must be positive, got (512, 0)"),
        ("SNAPFN_STREAM_RING_PINNING", "mlock", "must be register or alloc, got 'mlock'"),
    ],
)
def test_a_bad_value_is_refused_in_one_line_naming_its_variable(variable, raw, says):
    with pytest.raises(BadRequest) as refused:
        InitConfig.from_env({variable: raw})
    message = str(refused.value)
    assert variable in message and says in message and "\n" not in message


def test_to_env_reads_back_to_an_equal_config():
    config = InitConfig(
        graph_max_batch=4, overlap_speculative=False, prefill_chunk_sizes=(256, 1024)
    )
    assert InitConfig.from_env(config.to_env()) == config


def test_zero_turns_off_what_zero_may_turn_off():
    config = InitConfig.from_env({"SNAPFN_GRAPH_MAX_BATCH": "0", "SNAPFN_SPECULATIVE_TOKENS": "0"})
    assert config.graph_max_batch == 0 and config.speculative_tokens == 0
