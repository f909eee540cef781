"""`ServeConfig` (`handler/http/serve_config.py`): defaults, then SNAPFN_* variables, then flags."""

from __future__ import annotations

import pytest

from snapfn.handler.http.serve_config import ServeConfig
from snapfn.snapshot.errors import BadRequest


def test_serve_config_refuses_bad_values():
    with pytest.raises(BadRequest, match="SNAPFN_PORT"):
        ServeConfig.from_env({"SNAPFN_PORT": "eighty"})
    with pytest.raises(BadRequest, match="threads"):
        ServeConfig(threads=0)


def test_serve_config_from_env_then_overrides():
    env = {"SNAPFN_API_KEY": "k", "SNAPFN_PORT": "9000", "SNAPFN_STARTUP_WAIT_S": "2.5"}
    config = ServeConfig.from_env(env, port=9100, threads=None)
    assert (config.api_key, config.port, config.startup_wait_s) == ("k", 9100, 2.5)
    assert config.threads == ServeConfig().threads


def test_activator_settings_are_checked():
    assert ServeConfig().idle_timeout_s is None  # no activator unless asked for
    config = ServeConfig.from_env({"SNAPFN_IDLE_TIMEOUT_S": "30", "SNAPFN_MAX_INSTANCES": "2"})
    assert (config.idle_timeout_s, config.max_instances) == (30.0, 2)
    with pytest.raises(BadRequest, match="needs idle_timeout_s"):
        ServeConfig(max_instances=2)
    with pytest.raises(BadRequest, match="idle_timeout_s must be > 0"):
        ServeConfig(idle_timeout_s=0)
    with pytest.raises(BadRequest, match="target_concurrency"):
        ServeConfig(idle_timeout_s=1, target_concurrency=0)
