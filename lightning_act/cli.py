"""The ``lightning-act`` command: LightningCLI with the callback and the example classes.

``lightning-act fit --config configs/cifar10_resnet18.yaml`` trains from a YAML file;
every class of :mod:`lightning_act` and :mod:`lightning_act.examples` is accepted by its
short name (``class_path: ActCompression``, ``--model=ImageClassifier``). Without
``--config``, ``--model`` or ``--data``, the quickstart (``configs/quickstart.yaml``) is
the default configuration, so ``lightning-act fit`` alone trains a small network on
generated data. A rejected setting ends the command with one line naming the setting,
the value and what is allowed, and exit status 2.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import NoReturn

import lightning.pytorch as pl
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

# Short class names resolve only for imported classes.
import lightning_act  # noqa: F401
import lightning_act.examples  # noqa: F401

PROG = "lightning-act"
DESCRIPTION = (
    "Train, validate and test Lightning models with the activations saved for backward stored at 1-8 bits. "
    "Without --config, --model or --data, runs the quickstart (configs/quickstart.yaml)."
)
SUBCOMMANDS = ("fit", "validate", "test")

# Raised by a constructor (or the Trainer) over a bad setting: reported as one line.
# Anything else raised while building the objects is a bug and keeps its traceback.
CONFIG_ERRORS = (ValueError, FileNotFoundError, MisconfigurationException)


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
        # Nested parsers raise so that the enclosing parser can explain; only the
        # outermost one prints.
        if not self.exit_on_error:
            super().error(message, ex)
        sys.stderr.write(f"{self.prog.replace(' [options]', '')}: error: {one_line(message)}\n")
        self.exit(2)


class ActCLI(LightningCLI):
    """LightningCLI with the subcommands fit, validate and test.

    Any LightningModule and LightningDataModule subclass is accepted (``--model``,
    ``--data``), the resolved configuration is saved next to the logs (overwriting a
    previous one), and a bad setting fails in one line.

    Args:
        args: command line arguments (without the program name); ``None`` reads
            ``sys.argv``.
        run: run the subcommand; with ``False`` the objects are only built (no
            subcommand is parsed then).
        **kwargs: passed to :class:`~lightning.pytorch.cli.LightningCLI`.
    """

    def __init__(self, args: list[str] | None = None, run: bool = True, **kwargs):
        parser_kwargs = {"prog": PROG, "description": DESCRIPTION, **kwargs.pop("parser_kwargs", {})}
        quickstart = quickstart_config()
        if quickstart is not None and not _names_a_configuration(sys.argv[1:] if args is None else args):
            for subcommand in SUBCOMMANDS:
                parser_kwargs.setdefault(subcommand, {}).setdefault("default_config_files", [str(quickstart)])
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
    """Entry point of the ``lightning-act`` console script and of ``python -m lightning_act``.

    Args:
        args: command line arguments (without the program name); ``None`` reads
            ``sys.argv``.
    """
    ActCLI(args)


def _names_a_configuration(argv: list[str]) -> bool:
    """Whether the command line picks its own config, model or data (so no quickstart)."""
    return any(re.match(r"(-c|--config|--model|--data)(=|$)", arg) for arg in argv)


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
    """Condense jsonargparse's indented explanation of a rejected value into one line.

    The result names the setting, the value given and what is allowed, for example
    ``ImageClassifier (model): optimizer=adam is not valid; allowed: 'sgd', 'adamw'``.
    Messages that are already one line pass through unchanged.
    """
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
