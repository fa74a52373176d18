"""The settings tree (kvbridge/settings): one declaration per setting, from which the CLI,
the config dataclasses, the connection budget, the vLLM plug-in's extra-config keys and
docs/configuration.md's tables are made; a bad value anywhere is one line naming its source."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from kvbridge import cli
from kvbridge.config import SideChannelConfig
from kvbridge.errors import ConfigError
from kvbridge.settings import SETTINGS, ConnectionBudget, is_wildcard
from kvbridge.vllm.registration import REGISTRATION_KEYS
from kvbridge.vllm.settings import OUR_KEYS, PLUGIN_KEYS, load_settings
from tests.conftest import ROOT

# -- one declaration, several users ------------------------------------------------------

def test_side_channel_config_is_the_side_channel_group():
    names = [f.name for f in dataclasses.fields(SideChannelConfig) if f.name != "budget"]
    assert names == [s.name for s in SETTINGS.group("side_channel")]
    for s in SETTINGS.group("side_channel"):
        assert getattr(SideChannelConfig(), s.name) == s.default, s.name


def test_budget_is_the_budget_group():
    assert [f.name for f in dataclasses.fields(ConnectionBudget)] == [
        s.name for s in SETTINGS.group("budget")]
    assert ConnectionBudget() == ConnectionBudget(**{
        s.name: s.default for s in SETTINGS.group("budget")})


def test_vllm_extra_config_keys_are_the_trees():
    assert OUR_KEYS | PLUGIN_KEYS | REGISTRATION_KEYS == {s.name for s in SETTINGS if s.extra_config}


def test_every_env_name_belongs_to_one_setting():
    names = [e for s in SETTINGS for e in s.env_names]
    assert len(names) == len(set(names))
    assert all(e.startswith(("KVBRIDGE_", "VLLM_NIXL_")) for e in names)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "", "*", "0:0::0"])
def test_wildcards(host):
    assert is_wildcard(host)


@pytest.mark.parametrize("host", ["127.0.0.1", "10.0.0.1", "node-a", "::1"])
def test_not_wildcards(host):
    assert not is_wildcard(host)


# -- a bad value anywhere: one line naming the setting and its source --------------------

def _bad(s) -> str | None:
    """A value the setting refuses, or None (a free string)."""
    if s.choices or s.kind is not str:
        return "x!"
    return None


def _command(s) -> list[str]:
    if s.group == "proxy":
        return ["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    return ["serve", "--role", "prefill"]


# The plug-in's own settings are read by vLLM, not by a kvbridge command (tested below).
BAD_ENV = [(s, env) for s in SETTINGS for env in s.env_names
           if _bad(s) is not None and s.group != "vllm"]
PLUGIN_ENV = [(s, env) for s in SETTINGS.group("vllm") for env in s.env_names]


@pytest.mark.parametrize(("setting", "env"), BAD_ENV,
                         ids=[env for _, env in BAD_ENV])
def test_a_bad_environment_value_is_one_line(setting, env, monkeypatch, capsys):
    monkeypatch.setenv(env, "x!")
    assert cli.main(_command(setting)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"{env}='x!'" in err[0] and "configuration error" in err[0], err[0]


@pytest.mark.parametrize(("setting", "env"), PLUGIN_ENV, ids=[env for _, env in PLUGIN_ENV])
def test_a_bad_plugin_environment_value_is_one_line(setting, env):
    with pytest.raises(ConfigError) as e:
        load_settings({}, environ={env: "x!"})
    assert "\n" not in str(e.value) and f"{env}='x!'" in str(e.value), str(e.value)
    assert load_settings({}, environ={env: setting.default}) is not None


FLAGGED = [s for s in SETTINGS if s.flag and _bad(s) is not None
           and s.group in ("serve", "server", "proxy", "budget", "multinode", "side_channel")]


@pytest.mark.parametrize("setting", FLAGGED, ids=[s.name for s in FLAGGED])
def test_a_bad_flag_is_one_line(setting, capsys):
    assert cli.main([*_command(setting), setting.flag, "x!"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{setting.flag}='x!'" in err[0], err


def test_a_bad_extra_config_value_names_the_key():
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\['max_message_bytes'\]="
                                          r"'big': not an integer"):
        load_settings({"max_message_bytes": "big"}, environ={})


def test_the_environment_is_read_when_the_command_runs_not_by_the_parser():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVBRIDGE_NNODES": "x",
           "KVBRIDGE_ADMIN_ROUTES": "maybe"}
    for args in (["--help"], ["serve", "--help"], ["proxy", "--help"], ["settings"]):
        out = subprocess.run([sys.executable, "-m", "kvbridge.cli", *args], env=env,
                             capture_output=True, text=True, timeout=60,
                             stdin=subprocess.DEVNULL)
        assert out.returncode == 0 and "Traceback" not in out.stderr, (args, out.stderr)
    out = subprocess.run([sys.executable, "-m", "kvbridge.cli", "serve"], env=env,
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == ("kvbridge serve: configuration error: KVBRIDGE_NNODES='x': "
                                  "not an integer")


def test_parse_args_resolves_flag_then_environment_then_default():
    env = {"KVBRIDGE_NNODES": "2", "KVBRIDGE_MASTER_PORT": "3000"}
    args = cli.parse_args(["serve", "--master-port", "4000"], environ=env)
    assert (args.nnodes, args.master_port, args.node_rank, args.registry_ttl) == (2, 4000, 0, 10)
    assert args.host == "127.0.0.1" == cli.parse_args(["proxy"], environ={}).host


# -- settings reach the servers as objects, not through os.environ ------------------------

def test_flags_reach_the_servers_as_objects(monkeypatch):
    """The budget flags build the objects the servers get; the process environment is
    left as it was."""
    monkeypatch.delenv("KVBRIDGE_MAX_CONNECTIONS", raising=False)
    before = dict(os.environ)
    args = cli.parse_args(["serve", "--max-connections", "7", "--keep-alive-timeout", "2",
                           "--side-channel-keep-alive-timeout", "40"], environ={})
    budget = cli.connection_budget(args)
    side = SideChannelConfig.load(cli.side_channel_flags(args), {}, budget=budget)
    assert (budget.max_connections, budget.keep_alive_timeout) == (7, 2.0)
    assert (side.server_budget.max_connections, side.server_budget.keep_alive_timeout) == (7, 40.0)
    assert dict(os.environ) == before


def test_the_side_channel_keep_alive_is_its_own_setting():
    env = {"KVBRIDGE_KEEP_ALIVE_TIMEOUT": "2"}
    side = SideChannelConfig.load(None, env, budget=ConnectionBudget.load(None, env))
    assert side.budget is not None and side.budget.keep_alive_timeout == 2.0
    assert side.server_budget.keep_alive_timeout == 30.0


def test_one_default_bind_host():
    """The proxy and the engine API bind loopback unless told otherwise (deploy/k8s passes
    --host=0.0.0.0 itself), in the CLI and in the library functions alike."""
    import inspect

    from kvbridge.proxy import run_proxy
    from kvbridge.server.api import run_server
    from kvbridge.settings import DEFAULT_HOST

    assert SETTINGS["host"].default == DEFAULT_HOST == "127.0.0.1"
    for fn in (run_proxy, run_server):
        assert inspect.signature(fn).parameters["host"].default == DEFAULT_HOST, fn
