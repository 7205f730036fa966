"""The ``lightning-act`` command: LightningCLI with the callback and the example classes.

Every class of :mod:`lightning_act` and :mod:`lightning_act.examples` is accepted by its short name
(``class_path: ActCompression``, ``--model=ImageClassifier``). Without ``--config``, ``--model`` or
``--data``, ``configs/quickstart.yaml`` is the default. A rejected setting ends the command with one
line naming the setting, the value and what is allowed, and exit status 2.

A relative path that a config file gives to a model or data argument typed ``str | os.PathLike``
resolves against the repository root when run from a checkout, so ``configs/`` work from any folder;
one typed on the command line stays relative to the current folder. One of
``--trainer.callbacks.bits``, ``budget`` or ``memory_target`` on the command line resets a config's
other two to their defaults.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
import typing
import warnings
from pathlib import Path
from typing import Any, NoReturn

import lightning.pytorch as pl
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

# Short class names resolve only for imported classes.
import lightning_act
import lightning_act.examples  # noqa: F401
from lightning_act.callback import ActCompression

PROG = "lightning-act"
DESCRIPTION = (
    "Train, validate and test Lightning models with the activations saved for backward stored at 1-8 bits. "
    "Without --config, --model or --data, runs the quickstart (configs/quickstart.yaml)."
)
SUBCOMMANDS = ("fit", "validate", "test")
# fit --help lists the Trainer's options but not those of a callback inside its list.
CALLBACK_HELP = (
    "Train the model. The activation compression settings (bits, budget, rules, codec, ...) are listed by "
    f"`{PROG} fit --trainer.callbacks.help ActCompression`."
)

# Raised by a constructor (or the Trainer) over a bad setting: reported as one line.
# Anything else raised while building the objects is a bug and keeps its traceback.
CONFIG_ERRORS = (ValueError, FileNotFoundError, MisconfigurationException)


def repository_root() -> Path | None:
    """The checkout this package runs from (editable install or ``PYTHONPATH``); ``None`` when installed."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() and (root / "configs").is_dir() else None


def quickstart_config() -> Path | None:
    """``quickstart.yaml`` of an installed package (``lightning_act/_configs``) or of a checkout."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "_configs" / "quickstart.yaml", package.parent / "configs" / "quickstart.yaml"):
        if candidate.is_file():
            return candidate
    return None


class ActArgumentParser(LightningArgumentParser):
    """Reports a rejected setting in one line instead of jsonargparse's nested explanation."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        # Nested parsers raise so that the enclosing parser can explain; only the outermost prints.
        if not self.exit_on_error:
            super().error(message, ex)
        sys.stderr.write(f"{self.prog.replace(' [options]', '')}: error: {one_line(message)}\n")
        self.exit(2)


class ActCLI(LightningCLI):
    """LightningCLI with fit, validate and test, any LightningModule and LightningDataModule
    subclass, the resolved config saved next to the logs (overwriting), and one-line errors.

    Args:
        args: command line arguments (without the program name); ``None`` reads ``sys.argv``.
        run: run the subcommand; ``False`` only builds the objects (no subcommand is parsed).
        **kwargs: passed to :class:`~lightning.pytorch.cli.LightningCLI`.
    """

    def __init__(self, args: list[str] | None = None, run: bool = True, **kwargs):
        parser_kwargs = {"prog": PROG, "description": DESCRIPTION, **kwargs.pop("parser_kwargs", {})}
        self.command_line = sys.argv[1:] if args is None else list(args)
        quickstart = quickstart_config()
        if quickstart is not None and not _names_a_configuration(self.command_line):
            for subcommand in SUBCOMMANDS:
                parser_kwargs.setdefault(subcommand, {}).setdefault("default_config_files", [str(quickstart)])
        fit_kwargs = parser_kwargs.setdefault("fit", {})
        fit_kwargs.setdefault("description", CALLBACK_HELP)
        fit_kwargs.setdefault("epilog", CALLBACK_HELP)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(
            pl.LightningModule,
            pl.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            parser_class=ActArgumentParser,
            parser_kwargs=parser_kwargs,
            args=args,
            run=run,
            **kwargs,
        )

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name in SUBCOMMANDS}

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        given = _command_line_keys(self.command_line)
        root = repository_root()
        if root is not None:
            for key in ("model", "data"):
                _resolve_paths_from_config(config.get(key), key, root, given)
        _command_line_policy_wins(config.get("trainer"), given)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except CONFIG_ERRORS as error:
            cause = _root_cause(error)
            if not isinstance(cause, CONFIG_ERRORS):
                raise
            owner = _raising_class(cause)
            self._parser(self.subcommand).error(f"{owner}: {cause}" if owner else str(cause))


def main(args: list[str] | None = None) -> None:
    """Entry point of ``lightning-act`` and ``python -m lightning_act``.

    Args:
        args: command line arguments (without the program name); ``None`` reads ``sys.argv``.
    """
    # torch deprecates the LeafSpec check in Lightning's loaders: a warning no setting here can act on.
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )
    ActCLI(args)


def _names_a_configuration(argv: list[str]) -> bool:
    """Whether the command line picks its own config, model or data (so no quickstart)."""
    return any(re.match(r"(-c|--config|--model|--data)(=|$)", arg) for arg in argv)


def _command_line_keys(argv: list[str]) -> set[str]:
    """The dotted settings an argument list sets, ``init_args`` left out: ``{"data.root", ...}``."""
    keys = set()
    for arg in argv:
        match = re.match(r"--([\w.]+)", arg)
        if match:
            keys.add(match.group(1).replace(".init_args.", "."))
    return keys


def _resolve_paths_from_config(section: Any, key: str, root: Path, given: set[str]) -> None:
    """Resolve one class's (``model`` or ``data``) relative path arguments against ``root``, except
    those set on the command line."""
    if section is None or not isinstance(section.get("class_path"), str):
        return
    cls = _import(section["class_path"])
    init_args = section.get("init_args")
    if cls is None or init_args is None:
        return
    try:
        hints = typing.get_type_hints(cls.__init__)
    except (NameError, TypeError):  # annotations that do not evaluate here: no path argument to see
        return
    for name, hint in hints.items():
        value = init_args.get(name)
        if _is_path_type(hint) and isinstance(value, str) and not os.path.isabs(value) and f"{key}.{name}" not in given:
            init_args[name] = os.path.normpath(root / value)


def _is_path_type(hint: Any) -> bool:
    return hint is os.PathLike or os.PathLike in typing.get_args(hint)


#: The callback's ways to choose bits, one at a time.
_POLICY_KNOBS = ("bits", "budget", "memory_target")


def _command_line_policy_wins(trainer: Any, given: set[str]) -> None:
    """One of ``bits``, ``budget`` or ``memory_target`` set on the command line resets the other two
    in the callback it reaches (the list's last) when that is ActCompression."""
    callbacks = trainer.get("callbacks") if trainer is not None else None
    if not callbacks or not isinstance(callbacks, list) or not isinstance(callbacks[-1].get("class_path"), str):
        return
    cls = _import(callbacks[-1]["class_path"])
    init_args = callbacks[-1].get("init_args")
    if not (isinstance(cls, type) and issubclass(cls, ActCompression)) or init_args is None:
        return
    knobs = [knob for knob in _POLICY_KNOBS if f"trainer.callbacks.{knob}" in given]
    if len(knobs) == 1:
        defaults = inspect.signature(cls).parameters
        for other in _POLICY_KNOBS:
            if other != knobs[0]:
                init_args[other] = defaults[other].default


def _root_cause(error: BaseException) -> BaseException:
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def _raising_class(error: BaseException) -> str | None:
    """The class whose constructor raised ``error`` (the outermost ``__init__`` on its stack)."""
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "__init__":
            return code.co_qualname.rsplit(".", 1)[0]
        tb = tb.tb_next
    return None


# ----------------------------------------------------------------------- one-line errors
_PARSER_KEY = re.compile(r'\s*Parser key "([^"]+)":\s*(.*)')
_CLASS_PROBLEM = re.compile(r"(\s*)- Problem with given class_path '([^']+)':")
_EXPECTED_GOT = re.compile(r"\s*Expected a (.+?)\. Got value: (.*)")
_UNKNOWN_CLASS = re.compile(r"Expected a dot import path string: (\S+)")
_NOT_ACCEPTED = re.compile(r"\s*Option '([^']+)' is not accepted")


def one_line(message: str) -> str:
    """Condense jsonargparse's indented explanation of a rejected value into one line naming the
    setting, the value and what is allowed: ``ImageClassifier (model): optimizer=adam is not valid;
    allowed: 'sgd', 'adamw'``. One-line messages pass through unchanged."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    if len(lines) <= 1:
        return message.strip()
    header = _PARSER_KEY.match(lines[0])
    if header is None:
        return " ".join(line.strip() for line in lines)
    key, rest = header.groups()
    body = [rest, *lines[1:]] if rest else lines[1:]

    for i, line in enumerate(body):
        problem = _CLASS_PROBLEM.match(line)
        if problem:
            indent = len(problem.group(1))
            detail = []
            for nested in body[i + 1 :]:
                if len(nested) - len(nested.lstrip()) <= indent:
                    break
                detail.append(nested)
            class_path = problem.group(2)
            return f"{class_path.rsplit('.', 1)[-1]} ({key}): {_explain_class_problem(class_path, detail)}"

    text = "\n".join(body)
    unknown = _UNKNOWN_CLASS.search(text)
    if unknown:
        known = _known_subclasses(text)
        allowed = f"{', '.join(known)} or a full import path" if known else "a full import path"
        return f"{key}={unknown.group(1)} is not a known class; allowed: {allowed}"
    expected_got = _EXPECTED_GOT.match(body[0])
    if expected_got:
        return f"{key}={expected_got.group(2)} is not valid; allowed: {_pretty_type(expected_got.group(1))}"
    given = re.search(r"Given value: (.*)", text)
    expected = re.findall(r"- Expected a (.+)", text)
    if given and expected:
        return f"{key}={given.group(1)} is not valid; allowed: {', '.join(_pretty_type(t) for t in expected)}"
    return f"{key}: " + " ".join(line.strip() for line in body)


def _explain_class_problem(class_path: str, detail: list[str]) -> str:
    """One line for what the parser of ``class_path``'s arguments rejected."""
    not_accepted = _NOT_ACCEPTED.match(detail[0]) if detail else None
    if not_accepted is None:
        return one_line("\n".join(detail))
    accepted = _init_parameters(class_path)
    allowed = f"; allowed: {', '.join(accepted)}" if accepted else ""
    return f"option {not_accepted.group(1)!r} is not accepted{allowed}"


def _pretty_type(text: str) -> str:
    text = text.strip().rstrip(".")
    literal = re.fullmatch(r"(?:typing\.)?Literal\[(.*)\]", text)
    if literal:
        return literal.group(1)
    plain = re.fullmatch(r"<class '([^']+)'>", text)
    if plain:
        return "null" if plain.group(1) == "NoneType" else plain.group(1).rsplit(".", 1)[-1]
    return text


def _import(class_path: str) -> type | None:
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _init_parameters(class_path: str) -> list[str]:
    cls = _import(class_path)
    if cls is None:
        return []
    parameters = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in parameters if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _known_subclasses(text: str) -> list[str]:
    """Short names of the imported subclasses of the base class a union error lists."""
    subtypes = re.search(r"Subtypes: \[(.*)\]", text)
    base_path = re.search(r"([\w.]+\.[A-Z]\w*)", subtypes.group(1)) if subtypes else None
    base = _import(base_path.group(1)) if base_path else None
    if not isinstance(base, type):
        return []
    found, pending = set(), [base]
    while pending:
        for sub in pending.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                pending.append(sub)
    return sorted(
        {sub.__name__ for sub in found if not sub.__name__.startswith("_") and not sub.__module__.startswith("__")}
    )
