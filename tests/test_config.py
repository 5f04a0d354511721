"""tiers.config: AioConfig validation, describe() and from_env()."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tiers.config import (
    DIRECT_ALIGNMENT,
    MAX_TIMEOUT_S,
    AioConfig,
    Backend,
    check_timeout_s,
    parse_enum,
)
from tiers.errors import SwapConfigError, SwapError


def test_defaults() -> None:
    cfg = AioConfig()
    assert cfg.backend is Backend.AUTO
    assert cfg.block_size == 1 << 20
    assert cfg.queue_depth == 32
    assert cfg.num_threads == 1
    assert cfg.direct is True
    assert cfg.close_timeout_s == 60.0
    assert DIRECT_ALIGNMENT == 4096


def test_frozen_and_keyword_only() -> None:
    cfg = AioConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 4096  # type: ignore[misc]
    with pytest.raises(TypeError):
        AioConfig(Backend.THREADS)  # type: ignore[misc]


@pytest.mark.parametrize("name", ["auto", "libaio", "kernel", "threads"])
def test_backend_from_string(name: str) -> None:
    cfg = AioConfig(backend=name)  # type: ignore[arg-type]
    assert cfg.backend is Backend(name)
    assert isinstance(cfg.backend, Backend)


@pytest.mark.parametrize(
    ("kwargs", "setting", "hint"),
    [
        ({"backend": "bogus"}, "backend='bogus'", "auto, libaio, kernel, threads"),
        ({"backend": ""}, "backend=''", "one of"),
        ({"block_size": 1000}, "block_size=1000", "multiple of 4096"),
        ({"block_size": 4096 + 512}, "block_size=4608", "multiple of 4096"),
        ({"block_size": 0}, "block_size=0", "positive multiple"),
        ({"block_size": -4096}, "block_size=-4096", "positive multiple"),
        ({"queue_depth": 0}, "queue_depth=0", "between 1 and 1024"),
        ({"queue_depth": -1}, "queue_depth=-1", "between 1 and 1024"),
        ({"queue_depth": 1025}, "queue_depth=1025", "between 1 and 1024"),
        ({"num_threads": 0}, "num_threads=0", "between 1 and 64"),
        ({"num_threads": 65}, "num_threads=65", "between 1 and 64"),
        ({"close_timeout_s": 0}, "close_timeout_s=0", "> 0"),
        ({"close_timeout_s": -1.0}, "close_timeout_s=-1.0", "> 0"),
        ({"close_timeout_s": float("nan")}, "close_timeout_s=nan", "> 0"),
        # inf used to be accepted, then close() raised OverflowError from Condition.wait
        ({"close_timeout_s": float("inf")}, "close_timeout_s=inf", "finite"),
        ({"close_timeout_s": float("-inf")}, "close_timeout_s=-inf", "finite"),
        ({"close_timeout_s": 1e300}, "close_timeout_s=1e+300", "at most"),
        ({"close_timeout_s": 10**400}, "close_timeout_s=1000", "at most"),  # no OverflowError
        ({"close_timeout_s": -(10**400)}, "close_timeout_s=-1000", "> 0"),
        ({"close_timeout_s": None}, "close_timeout_s=None", "number of seconds"),
        ({"close_timeout_s": True}, "close_timeout_s=True", "number of seconds"),
        ({"close_timeout_s": [5]}, "close_timeout_s=[5]", "number of seconds"),
    ],
)
def test_validation_names_the_setting(kwargs: dict, setting: str, hint: str) -> None:
    with pytest.raises(SwapConfigError) as info:
        AioConfig(**kwargs)
    msg = str(info.value)
    assert setting in msg
    assert hint in msg
    # a config error is a ValueError too, and one of ours
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, SwapError)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 4096},
        {"block_size": 64 << 20},
        {"queue_depth": 1},
        {"queue_depth": 1024},
        {"num_threads": 1},
        {"num_threads": 64},
        {"close_timeout_s": 0.001},
        {"close_timeout_s": 7},
        {"close_timeout_s": MAX_TIMEOUT_S},
        {"direct": False},
    ],
)
def test_limits_accepted(kwargs: dict) -> None:
    cfg = AioConfig(**kwargs)
    for key, value in kwargs.items():
        assert getattr(cfg, key) == value


def test_describe() -> None:
    described = AioConfig(backend=Backend.LIBAIO).describe()
    assert described == "libaio, bs 1 MiB, qd 32, threads 1, direct"
    cfg = AioConfig(
        backend=Backend.THREADS, block_size=8192, queue_depth=2, num_threads=3, direct=False
    )
    assert cfg.describe() == "threads, bs 8 KiB, qd 2, threads 3, buffered"


# -- from_env -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("var", "text", "attr", "value"),
    [
        ("SWAPPER_AIO_BACKEND", "threads", "backend", Backend.THREADS),
        ("SWAPPER_AIO_BACKEND", "kernel", "backend", Backend.KERNEL),
        ("SWAPPER_AIO_BLOCK_SIZE", "8MiB", "block_size", 8 << 20),
        ("SWAPPER_AIO_BLOCK_SIZE", "65536", "block_size", 65536),
        ("SWAPPER_AIO_BLOCK_SIZE", "64k", "block_size", 65536),
        ("SWAPPER_AIO_QUEUE_DEPTH", "8", "queue_depth", 8),
        ("SWAPPER_AIO_THREADS", "4", "num_threads", 4),
        ("SWAPPER_AIO_DIRECT", "0", "direct", False),
        ("SWAPPER_AIO_DIRECT", "false", "direct", False),
        ("SWAPPER_AIO_DIRECT", "No", "direct", False),
        ("SWAPPER_AIO_DIRECT", "off", "direct", False),
        ("SWAPPER_AIO_DIRECT", "1", "direct", True),
        ("SWAPPER_AIO_DIRECT", " TRUE ", "direct", True),
        ("SWAPPER_AIO_DIRECT", "yes", "direct", True),
        ("SWAPPER_AIO_DIRECT", "on", "direct", True),
        ("SWAPPER_AIO_CLOSE_TIMEOUT", "2.5", "close_timeout_s", 2.5),
        ("SWAPPER_AIO_CLOSE_TIMEOUT", "30", "close_timeout_s", 30.0),
    ],
)
def test_from_env_each_variable(var: str, text: str, attr: str, value: object) -> None:
    cfg = AioConfig.from_env({var: text})
    assert getattr(cfg, attr) == value
    # the others keep their defaults
    default = AioConfig()
    for field in dataclasses.fields(AioConfig):
        if field.name != attr:
            assert getattr(cfg, field.name) == getattr(default, field.name)


def test_from_env_all_variables_at_once() -> None:
    cfg = AioConfig.from_env(
        {
            "SWAPPER_AIO_BACKEND": "threads",
            "SWAPPER_AIO_BLOCK_SIZE": "2MiB",
            "SWAPPER_AIO_QUEUE_DEPTH": "4",
            "SWAPPER_AIO_THREADS": "2",
            "SWAPPER_AIO_DIRECT": "off",
            "SWAPPER_AIO_CLOSE_TIMEOUT": "5",
            "SWAPPER_AIO_UNRELATED": "ignored",
            "PATH": "/bin",
        }
    )
    assert cfg == AioConfig(
        backend=Backend.THREADS,
        block_size=2 << 20,
        queue_depth=4,
        num_threads=2,
        direct=False,
        close_timeout_s=5.0,
    )


def test_from_env_empty_is_default() -> None:
    assert AioConfig.from_env({}) == AioConfig()


def test_from_env_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWAPPER_AIO_QUEUE_DEPTH", "7")
    monkeypatch.setenv("SWAPPER_AIO_BACKEND", "threads")
    cfg = AioConfig.from_env()
    assert cfg.queue_depth == 7
    assert cfg.backend is Backend.THREADS


def test_from_env_overrides_win() -> None:
    cfg = AioConfig.from_env(
        {"SWAPPER_AIO_QUEUE_DEPTH": "7", "SWAPPER_AIO_THREADS": "3"}, queue_depth=9
    )
    assert cfg.queue_depth == 9
    assert cfg.num_threads == 3


def test_from_env_unparsable_variable_reported_even_when_overridden() -> None:
    """A value that does not parse is reported even when an override would replace it."""
    with pytest.raises(SwapConfigError, match="SWAPPER_AIO_QUEUE_DEPTH"):
        AioConfig.from_env({"SWAPPER_AIO_QUEUE_DEPTH": "many"}, queue_depth=9)


@pytest.mark.parametrize(
    ("var", "text"),
    [
        ("SWAPPER_AIO_BLOCK_SIZE", "big"),
        ("SWAPPER_AIO_BLOCK_SIZE", "-4KiB"),
        ("SWAPPER_AIO_BLOCK_SIZE", "4XB"),
        ("SWAPPER_AIO_QUEUE_DEPTH", "many"),
        ("SWAPPER_AIO_QUEUE_DEPTH", "2.5"),
        ("SWAPPER_AIO_THREADS", "four"),
        ("SWAPPER_AIO_THREADS", ""),
        ("SWAPPER_AIO_DIRECT", "maybe"),
        ("SWAPPER_AIO_DIRECT", ""),
        ("SWAPPER_AIO_CLOSE_TIMEOUT", "soon"),
    ],
)
def test_from_env_unparsable_value_names_the_variable(var: str, text: str) -> None:
    with pytest.raises(SwapConfigError) as info:
        AioConfig.from_env({var: text})
    msg = str(info.value)
    assert var in msg
    assert repr(text) in msg


@pytest.mark.parametrize(
    ("var", "text"),
    [
        ("SWAPPER_AIO_BACKEND", "bogus"),
        ("SWAPPER_AIO_BLOCK_SIZE", "1000"),
        ("SWAPPER_AIO_QUEUE_DEPTH", "0"),
        ("SWAPPER_AIO_THREADS", "0"),
        ("SWAPPER_AIO_CLOSE_TIMEOUT", "0"),
        ("SWAPPER_AIO_CLOSE_TIMEOUT", "inf"),
        ("SWAPPER_AIO_CLOSE_TIMEOUT", "nan"),
        ("SWAPPER_AIO_CLOSE_TIMEOUT", "-5"),
    ],
)
def test_from_env_invalid_value_names_the_variable(var: str, text: str) -> None:
    with pytest.raises(SwapConfigError) as info:
        AioConfig.from_env({var: text})
    assert var in str(info.value)


@pytest.mark.parametrize(
    ("var", "text", "setting"),
    [
        ("SWAPPER_AIO_BACKEND", "bogus", "backend"),
        ("SWAPPER_AIO_BLOCK_SIZE", "1000", "block_size"),
        ("SWAPPER_AIO_QUEUE_DEPTH", "0", "queue_depth"),
        ("SWAPPER_AIO_THREADS", "0", "num_threads"),
        ("SWAPPER_AIO_CLOSE_TIMEOUT", "0", "close_timeout_s"),
    ],
)
def test_from_env_invalid_value_is_a_config_error(var: str, text: str, setting: str) -> None:
    """The error is a SwapConfigError naming the setting too."""
    with pytest.raises(SwapConfigError, match=setting):
        AioConfig.from_env({var: text})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_threads": 2.5},
        {"queue_depth": 1.5},
        {"block_size": 8192.0},
        {"direct": "no"},
        {"close_timeout_s": "5"},
    ],
    ids=["num_threads-float", "queue_depth-float", "block_size-float", "direct-str", "timeout-str"],
)
def test_wrong_types_are_config_errors(kwargs: dict) -> None:
    with pytest.raises(SwapConfigError, match=next(iter(kwargs))):
        AioConfig(**kwargs)


@pytest.mark.parametrize(
    "mapping",
    [{"close_timeout_s": "inf"}, {"close_timeout_s": float("inf")}, {"close_timeout_s": 0}],
    ids=["str-inf", "float-inf", "zero"],
)
def test_from_dict_refuses_unusable_timeouts(mapping: dict) -> None:
    with pytest.raises(SwapConfigError, match=r"close_timeout_s=.*finite number of seconds"):
        AioConfig.from_dict(mapping)


def test_every_timeout_setting_is_checked() -> None:
    """Each field whose name says seconds refuses inf: no timeout setting is forgotten."""
    timeouts = [f.name for f in dataclasses.fields(AioConfig) if f.name.endswith("_s")]
    assert timeouts, "AioConfig has no timeout setting any more: update this test"
    for name in timeouts:
        kwargs: dict[str, Any] = {name: float("inf")}
        with pytest.raises(SwapConfigError, match=f"{name}=inf"):
            AioConfig(**kwargs)


def test_check_timeout_s() -> None:
    assert check_timeout_s("t", 3) == 3.0
    assert isinstance(check_timeout_s("t", 3), float)
    with pytest.raises(ValueError, match="t=inf must be a finite"):
        check_timeout_s("t", float("inf"))
    with pytest.raises(SwapConfigError, match="t=0"):
        check_timeout_s("t", 0, SwapConfigError)


# -- parse_enum: the one enum-from-string of the settings ---------------------------------


@pytest.mark.parametrize("value", ["threads", Backend.THREADS])
def test_parse_enum_takes_a_member_or_its_value(value: object) -> None:
    assert parse_enum(Backend, value, "backend") is Backend.THREADS


@pytest.mark.parametrize("value", ["Threads", "", None, 3, ["threads"]])
def test_parse_enum_names_the_setting_and_every_value(value: object) -> None:
    with pytest.raises(SwapConfigError) as caught:
        parse_enum(Backend, value, "backend")
    assert str(caught.value) == (
        f"backend={value!r} is not one of: {', '.join(b.value for b in Backend)}"
    )


def test_parse_enum_raises_the_error_type_asked_for() -> None:
    with pytest.raises(KeyError, match=r"policy='x' is not one of"):
        parse_enum(Backend, "x", "policy", KeyError)
