"""Service settings: config/default.toml, then the file named by SPECDEC_CONFIG, then SPECDEC_* variables.

`load_settings` merges the layers, validates the result once and raises one ConfigError naming every bad
key and where its value came from. Decoding defaults here are what a request gets when it leaves a field out;
limits are never overridden by a request.
"""

import difflib
import importlib
import ipaddress
import logging
import os
import re
import tomllib
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import SpecDecError
from ..params import (
    ADAPTIVE_MAX_GAMMA,
    DRAFTERS,
    LOOKUP_KEYS,
    MAX_GAMMA,
    MAX_LOOKUP,
    SERVED_METHODS,
    VERIFICATIONS,
    LookupSettings,
    SamplingParams,
)

DEFAULT_FILE = Path(__file__).resolve().parents[2] / "config" / "default.toml"
ENV_PREFIX = "SPECDEC_"
CONFIG_ENV = "SPECDEC_CONFIG"
logger = logging.getLogger(__name__)
ADAPTIVE = "adaptive"
NONE = ("none", "null")  # besides "auto" or "adaptive", the words for a setting's automatic value
# a web origin, as a browser sends it in Origin: a host name, an IPv4 address or a bracketed IPv6 one, and a port
ORIGIN = re.compile(r"https?://(\[[0-9A-Fa-f:.]+\]|[^/\s,:\[\]]+)(:(?P<port>\d{1,5}))?")
HOST = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")  # a host name (or an IPv4 address)
# the longest any timeout may be: a day's timeouts are already beyond any client's; much longer overflow the
# waits that take them (a thread's wait refuses more than about 9.2e9 s)
MAX_SECONDS = 1_000_000


class ConfigError(ValueError):
    """Configuration that the service cannot start with. The message says which key, from where, and why."""


# bounds a setting and a request field share (SamplingParams checks the same ones, for every caller)
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]


GAMMA_WORDS = f'must be an integer of at least 1, or "{ADAPTIVE}"'  # a gamma that is neither, setting or request


def _gamma(value):
    if isinstance(value, str) and value != ADAPTIVE:  # one clear message, not the union's first branch's
        raise ValueError(GAMMA_WORDS)
    return value


# draft tokens per round, or "adaptive": chosen each round
Gamma = Annotated[Annotated[int, Field(ge=1)] | Literal["adaptive"], BeforeValidator(_gamma)]
Probability = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]


class Settings(BaseModel):
    """The validated service configuration. Every key except `loader` has its default in config/default.toml."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    host: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    target_model: str = Field(min_length=1)
    draft_model: str = Field(min_length=1)
    device: str = Field(min_length=1)
    dtype: Literal["auto", "float32", "float16", "bfloat16"]
    # accelerate's device map for the target ("none": the whole target on `device`)
    device_map: Literal["none", "auto", "balanced", "balanced_low_0", "sequential"]
    trust_remote_code: bool  # run a hub model's own code (its repository's modeling files)
    draft_quantization: Literal["auto", "int8", "int4", "none"]
    compile: Literal["auto", "true", "false"]
    weights: Literal["shipped", "float"]
    quantize: Literal["none", "int4", "int8"]
    draft_vocab_size: int | None = Field(ge=0)  # None ("auto"): 65,536 for the default pair, else the whole vocabulary
    method: Literal[SERVED_METHODS]
    drafter: Literal[DRAFTERS]
    verification: Literal[VERIFICATIONS]
    # None ("auto"): default_pair.CONFIDENCE_THRESHOLD for the default pair loaded by the default loader, else 0
    draft_confidence_threshold: Probability | None
    gamma: int | None = Field(ge=1)  # None: adaptive
    max_gamma: int = Field(ge=1, le=MAX_GAMMA)
    temperature: float = Field(ge=0, allow_inf_nan=False)
    top_p: TopP
    top_k: int = Field(ge=0)
    max_new_tokens: int = Field(ge=1)
    lookup_max_ngram: int = Field(ge=1, le=MAX_LOOKUP)
    lookup_max_tokens: int = Field(ge=1, le=MAX_LOOKUP)
    lookup_min_match: int = Field(ge=1)
    hybrid_min_match: int = Field(ge=1)
    hybrid_extend: bool
    # the prompt cache's byte budget (specdec/prompt_cache.py); None ("auto"): chosen at load time from the weights
    # and the memory (prompt_cache.default_budget); 0: off
    prompt_cache_bytes: int | None = Field(ge=0)
    max_new_tokens_limit: int = Field(ge=1)
    max_prompt_tokens: int = Field(ge=1)
    max_prompts_per_request: int = Field(ge=1, le=1024)  # /v1: choices in one request (prompts times n)
    queue_size: int = Field(ge=0)
    queue_timeout: float = Field(gt=0, le=MAX_SECONDS, allow_inf_nan=False)
    request_timeout: float = Field(gt=0, le=MAX_SECONDS, allow_inf_nan=False)
    stream_interval: float = Field(ge=0, le=1, allow_inf_nan=False)
    max_body_bytes: int = Field(ge=1024)
    retry_after: int = Field(ge=1)
    header_timeout: float = Field(gt=0, le=MAX_SECONDS, allow_inf_nan=False)
    body_timeout: float = Field(gt=0, le=MAX_SECONDS, allow_inf_nan=False)
    # a file of API keys, one a line ("" = none: no key needed); checked here, read again by auth.py
    api_keys_file: str
    metrics_public: bool
    # origins whose browser pages may call the API (CORS), comma-separated, or "*" for any; "" = none (no CORS)
    cors_allow_origins: str
    log_level: Literal["debug", "info", "warning", "error"]
    # loader(settings) -> (draft, target, tokenizer); None: specdec.load_pair with the model settings.
    # A "package.module:function" string is imported here, so a bad path fails at start-up.
    loader: Callable | None = None

    @field_validator("*", mode="before")
    @classmethod
    def _exact_number(cls, value, info):
        """A number setting takes a number: not a TOML boolean (pydantic's lax mode reads `true` as 1), and an
        integer setting no fraction (`5000.0`, "5000.0")."""
        annotation = cls.model_fields[info.field_name].annotation
        kinds = {_bare(kind) for kind in typing.get_args(annotation) or (annotation,)}  # Probability | None: float
        if not kinds & {int, float}:
            return value
        if isinstance(value, bool):
            raise ValueError(f"must be a number, not {str(value).lower()}")
        if float not in kinds and (isinstance(value, float) or isinstance(value, str) and not _integral(value)):
            raise ValueError(f"must be an integer, got {value!r}")
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        """The device as the loader takes it (surrounding spaces dropped, `auto` in any case); whether this machine
        has it is checked where the models load (the master never touches the GPU)."""
        value = value.strip()
        if value.lower() == "auto":
            return "auto"
        import torch  # only here, as `confidence_threshold` imports the model sources (and torch) only there

        try:
            torch.device(value)
        except (RuntimeError, TypeError):
            raise ValueError("must be auto, cpu, cuda, cuda:N or another device torch names") from None
        return value

    @field_validator("host")
    @classmethod
    def _host(cls, value: str) -> str:
        value = value.strip()
        try:
            ipaddress.ip_address(value)
        except ValueError:
            # digits and dots are an IPv4 address, not a name (no top-level domain is numeric): 999.1.1.1 is refused
            if not HOST.fullmatch(value) or re.fullmatch(r"[0-9.]+", value):
                raise ValueError("must be a host name or an IP address (an IPv6 address without brackets: ::1)") \
                    from None
        return value

    @field_validator("gamma", mode="before")
    @classmethod
    def _adaptive(cls, value):
        """"adaptive" (or the CLI's "auto", "none", "null"): None, chosen each round."""
        if isinstance(value, str) and value.strip().lower() in (ADAPTIVE, "auto", *NONE):
            return None
        if isinstance(value, str) and not _integral(value):
            raise ValueError(GAMMA_WORDS)
        return value

    @field_validator("prompt_cache_bytes", "draft_vocab_size", "draft_confidence_threshold", mode="before")
    @classmethod
    def _auto(cls, value):
        if isinstance(value, str) and value.strip().lower() in ("auto", *NONE):
            return None
        return value

    @field_validator("log_level", "dtype", "device_map", "draft_quantization", "drafter", "verification", "compile",
                     "weights", "quantize", mode="before")
    @classmethod
    def _lower(cls, value):
        if isinstance(value, bool):  # compile = true in a TOML file
            return "true" if value else "false"
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("cors_allow_origins")
    @classmethod
    def _origins(cls, value: str) -> str:
        for origin in cors_origins(value):
            if origin != "*" and (not (match := ORIGIN.fullmatch(origin)) or int(match["port"] or 0) > 65535):
                raise ValueError(f"{origin!r} is not an origin: write scheme://host[:port] (no path), or * for any; "
                                 "several, comma-separated")
        return value

    @field_validator("api_keys_file")
    @classmethod
    def _keys_readable(cls, value: str) -> str:
        if value.strip():
            read_api_keys(value)  # a ConfigError (a ValueError) names the problem, never a key
        return value

    @field_validator("loader", mode="before")
    @classmethod
    def _import_loader(cls, value):
        if not isinstance(value, str):
            return value
        if not value:
            return None
        module_name, _, attribute = value.partition(":")
        if not module_name or not attribute:
            raise ValueError(f"must look like 'package.module:function', got {value!r}")
        try:
            return getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"cannot import {value!r}: {error}") from None

    @property
    def sampling(self) -> SamplingParams:
        """The decoding defaults a request gets for the fields it leaves out (no seed: each request draws one)."""
        return SamplingParams(max_new_tokens=self.max_new_tokens, method=self.method, gamma=self.gamma,
                              temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, drafter=self.drafter,
                              verification=self.verification,
                              draft_confidence_threshold=self.confidence_threshold)

    @property
    def confidence_threshold(self) -> float:
        """draft_confidence_threshold, "auto" resolved: default_pair.CONFIDENCE_THRESHOLD where the service loads
        the default pair itself (both models name it, no custom loader), else 0."""
        if self.draft_confidence_threshold is not None:
            return self.draft_confidence_threshold
        if self.loader is not None:  # a custom loader's pair, whatever the model settings name
            return 0.0
        from ..models.sources import auto_confidence_threshold

        return auto_confidence_threshold(self.draft_model, self.target_model)

    @property
    def takes_adaptive_gamma(self) -> bool:
        """Whether max_gamma allows the draft lengths adaptive gamma chooses (up to ADAPTIVE_MAX_GAMMA)."""
        return self.max_gamma >= ADAPTIVE_MAX_GAMMA

    @property
    def lookup(self) -> LookupSettings:
        """Prompt lookup's settings, for every request's lookup and hybrid drafters."""
        return LookupSettings(**{field: getattr(self, key) for field, key in LOOKUP_KEYS.items()})

    @model_validator(mode="after")
    def _consistent(self):
        if self.max_new_tokens > self.max_new_tokens_limit:
            raise ValueError(f"max_new_tokens ({self.max_new_tokens}) exceeds max_new_tokens_limit "
                             f"({self.max_new_tokens_limit})")
        if self.gamma is not None and self.gamma > self.max_gamma:
            raise ValueError(f"gamma ({self.gamma}) exceeds max_gamma ({self.max_gamma})")
        if self.gamma is None and not self.takes_adaptive_gamma:
            raise ValueError(f"gamma adaptive proposes up to {ADAPTIVE_MAX_GAMMA} tokens a round, past max_gamma "
                             f"({self.max_gamma})")
        try:
            self.sampling  # noqa: B018 - the defaults must be valid sampling parameters
        except SpecDecError as error:
            raise ValueError(f"{error.field}: {error.message}") from None
        try:  # LookupSettings' rules (a match at most max_ngram long; its default hybrid_min_match cut to it)
            self.lookup  # noqa: B018
        except SpecDecError as error:
            key, limit = LOOKUP_KEYS.get(error.field, error.field), LOOKUP_KEYS["max_ngram"]
            if error.field in ("min_match", "hybrid_min_match") and getattr(self, key) > getattr(self, limit):
                raise ValueError(f"{key} ({getattr(self, key)}) exceeds {limit} ({getattr(self, limit)})") from None
            raise ValueError(f"{key}: {error.message}") from None
        return self


def _bare(annotation):
    """An annotated type's own type (Annotated[float, Field(...)]: float)."""
    return typing.get_args(annotation)[0] if typing.get_origin(annotation) is Annotated else annotation


def _integral(text: str) -> bool:
    """Whether an integer setting's text is an integer as Python writes one ("5", "+5", "5_000") or a word the
    setting takes for its automatic value ("auto", "adaptive", "none", "null")."""
    if text.strip().lower() in ("auto", ADAPTIVE, *NONE):
        return True
    try:
        int(text.strip())
    except ValueError:
        return False
    return True


def cors_origins(value: str) -> list[str]:
    """`cors_allow_origins` as a list: the comma-separated origins, a trailing slash left out; [] when unset."""
    return [origin.strip().rstrip("/") for origin in value.split(",") if origin.strip()]


def read_api_keys(path: str) -> tuple[str, ...]:
    """The keys in a keys file: one a line, surrounding whitespace dropped, blank lines and `#` comments skipped.
    A ConfigError if the file is missing, unreadable or holds no key (its message never quotes the file's text)."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) dropped
    except FileNotFoundError:
        raise ConfigError(f"the API keys file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else "it is not UTF-8 text"
        raise ConfigError(f"cannot read the API keys file {path}: {reason}") from None
    keys = tuple(line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ConfigError(f"the API keys file {path} holds no key (one a line; blank lines and # comments are "
                          f"skipped)")
    return keys


def _read_toml(path: Path, what: str) -> dict:
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"cannot read {what} {path}: {error}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"cannot read {what} {path}: it is not UTF-8 text") from None


def _from_env(environ: Mapping[str, str]) -> dict:
    """SPECDEC_<KEY> for every setting; an empty variable counts as unset. A SPECDEC_ variable that is no setting
    but nearly one's name (SPECDEC_GAMA), or a setting's name cut short at a word (SPECDEC_TARGET, SPECDEC_MODEL),
    is logged as a likely mistake; other SPECDEC_ variables (the cache's, a platform's) are left alone."""
    names = [ENV_PREFIX + name.upper() for name in Settings.model_fields]
    for variable in sorted(set(environ) - set(names) - {CONFIG_ENV, "SPECDEC_CACHE"}):
        if not variable.startswith(ENV_PREFIX):
            continue
        word = variable.removeprefix(ENV_PREFIX)
        near = [name for name in sorted(names) if name.startswith(variable + "_") or name.endswith("_" + word)] \
            or difflib.get_close_matches(variable, names, n=1, cutoff=0.85)
        if near:
            logger.warning("%s is not a setting and is ignored: did you mean %s?", variable, " or ".join(near))
    return {name: environ[ENV_PREFIX + name.upper()] for name in Settings.model_fields
            if environ.get(ENV_PREFIX + name.upper(), "").strip()}


def load_settings(overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None,
                  defaults: Path = DEFAULT_FILE) -> Settings:
    """Merge defaults < $SPECDEC_CONFIG file < SPECDEC_* variables < overrides, and validate the result."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}

    def layer(source: Mapping[str, Any], name) -> None:
        for key, value in source.items():
            values[key] = value
            origin[key] = name(key)

    if not defaults.is_file() and defaults == DEFAULT_FILE:  # a wheel installed alone: config/ is the checkout's
        raise ConfigError(f"the defaults file {defaults} does not exist: the service reads config/ from the project's "
                          "checkout; install it editable there (pip install -e ., as make does)")
    layer(_read_toml(defaults, "the defaults file"), lambda key: str(defaults))
    if environ.get(CONFIG_ENV, "").strip():
        path = Path(environ[CONFIG_ENV]).expanduser()
        layer(_read_toml(path, f"the file named by {CONFIG_ENV},"), lambda key: str(path))
    layer(_from_env(environ), lambda key: ENV_PREFIX + key.upper())
    layer(overrides or {}, lambda key: "create_app")

    try:
        return Settings(**values)
    except ValidationError as error:
        problems = []
        for item in error.errors():
            key = str(item["loc"][0]) if item["loc"] else None
            message = item["msg"].removeprefix("Value error, ")
            if item["type"] == "extra_forbidden":
                problems.append(f"unknown setting {key!r} (from {origin[key]})")
            elif item["type"] == "missing":
                problems.append(f"{key} is not set (add it to {defaults})")
            elif key is None:  # a check of several keys: where each it names came from
                named = [name for name in values if re.search(rf"\b{name}\b", message)]
                problems.append(message + (" (" + ", ".join(f"{name} from {origin[name]}" for name in named) + ")"
                                           if named else ""))
            else:
                problems.append(f"{key} = {values[key]!r} (from {origin[key]}): {message}")
        raise ConfigError("invalid configuration: " + "; ".join(problems)) from None
