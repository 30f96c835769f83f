"""Pieces every command shares: the capture options, the CLI session, errors and output.

The shared options arrive as one :class:`CaptureOptions`; a command turns them into the
library's :class:`~attnviz.request.CaptureRequest` (:meth:`CaptureOptions.request`) and asks the
CLI :func:`session` one question with it, e.g. ``session().run(options.request(layer=5))``.

Only typer, rich and the standard library are imported here, so ``attnviz --help`` stays fast.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar, cast

import typer
from rich.console import Console

from attnviz.errors import AttnvizError, UsageError

if TYPE_CHECKING:
    from attnviz.capture import Capture
    from attnviz.models import ModelSpec
    from attnviz.request import CaptureRequest
    from attnviz.session import Session

F = TypeVar("F", bound=Callable[..., Any])

stdout = Console(highlight=False, soft_wrap=True)
stderr = Console(stderr=True, highlight=False, soft_wrap=True)

INPUT_PANEL = "Input"
MODEL_PANEL = "Model"
TOY_PANEL = "Toy model (--model toy)"
LONG_PANEL = "Long inputs"
#: The commands with a long path (``--long``); the others need every weight at once.
LONG_COMMANDS = ("heatmap", "top-k", "heads", "dump", "export")
VIEW_PANEL = "What to show"
OUTPUT_PANEL = "Output"


def warn(message: str) -> None:
    """Print a warning on standard error."""
    stderr.print(f"[yellow]Warning:[/yellow] {message}", markup=True, highlight=False)


def report_error(error: AttnvizError) -> None:
    """Print ``Error: <message>`` and the hint on standard error."""
    from rich.markup import escape

    stderr.print(f"[bold red]Error:[/bold red] {escape(error.message)}")
    if error.hint:
        stderr.print(escape(error.hint))


def handle_errors(func: F) -> F:
    """Turn :class:`AttnvizError` into a message and exit code; ``ATTNVIZ_DEBUG=1`` re-raises."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except AttnvizError as error:
            if os.environ.get("ATTNVIZ_DEBUG", "") not in ("", "0"):
                raise
            report_error(error)
            raise typer.Exit(error.exit_code) from None

    return wrapper  # type: ignore[return-value]


def _hide_flag_types() -> None:
    """Keep Typer's rich help from printing a ``<bool>`` type after on/off flags.

    Recent Typer versions print every option's type in ``--help``, flags included, so
    ``--exclude-special <bool>`` read as if the flag took a value and users typed
    ``--exclude-special true``. A flag takes no value: its type column stays empty, as in
    click's plain help. Older Typer versions have no such column and are left alone.
    """
    try:
        from typer.core import TyperOption
    except ImportError:  # pragma: no cover - typer without its core module
        return
    original = getattr(TyperOption, "display_type_rich", None)
    if original is None or getattr(original, "hides_flag_types", False):
        return

    def display_type_rich(self: Any, ctx: Any) -> str | None:
        if getattr(self, "is_flag", False) and not getattr(self, "count", False):
            return None
        return cast("str | None", original(self, ctx))

    display_type_rich.hides_flag_types = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_hide_flag_types()


# --------------------------------------------------------------------------- shared options
LayerOpt = Annotated[Any, typer.Option("--layer", "-l", rich_help_panel=VIEW_PANEL,
                                       help="Layer index, 0-based; negative counts from the end.")]
LayersOpt = Annotated[str | None, typer.Option(
    "--layers", rich_help_panel=VIEW_PANEL, metavar="SEL",
    help="Layers to keep, e.g. 0,2-4 or -1 (default: all).")]
HeadsOpt = Annotated[str | None, typer.Option(
    "--heads", rich_help_panel=VIEW_PANEL, metavar="SEL",
    help="Heads to keep, e.g. 0-5 (default: all).")]
CmapOpt = Annotated[str, typer.Option(
    "--cmap", rich_help_panel=OUTPUT_PANEL,
    help="Colour map: matplotlib's (viridis, magma, Blues, ...) or seaborn's perceptually "
         "uniform rocket, mako, flare, crest, vlag, icefire (_r reverses any).")]
DpiOpt = Annotated[int, typer.Option("--dpi", min=20, max=600, rich_help_panel=OUTPUT_PANEL,
                                     help="Resolution of raster images.")]
ExcludeSpecialOpt = Annotated[bool, typer.Option(
    "--exclude-special", rich_help_panel=VIEW_PANEL,
    help="Drop [CLS]/[SEP]/<s> rows and columns and renormalise each row to sum to 1 "
         "(with --words: after merging the words).")]
WordsOpt = Annotated[bool, typer.Option(
    "--words", rich_help_panel=VIEW_PANEL,
    help="Merge subword tokens into words: attention to a word is the sum over its pieces, "
         "from a word the mean (rows still sum to 1).")]

MeasureOpt = Annotated[str | None, typer.Option(
    "--measure", rich_help_panel=VIEW_PANEL, metavar="NAME", show_default=False,
    help="What to show: weights (attention, the default), norm (||\u03b1f(x)||, Kobayashi et "
         "al. 2020), norm-res-ln (with the residual and LayerNorm, Kobayashi et al. 2021), alti "
         "(Ferrando et al. 2022) or value-zeroing (Mohebbi et al. 2023); Hugging Face models "
         "only. With --from: the saved capture's own (a long capture holds weights). Example: "
         "--measure norm.")]

# Figure options: windows and the colour scale (attnviz.render.heatmap.ColourScale).
TokensOpt = Annotated[str | None, typer.Option(
    "--tokens", rich_help_panel=VIEW_PANEL, metavar="A:B",
    help="Zoom in: show tokens A to B-1 as queries and keys (0-based, negative from the end, "
         "either end may be left out: 40:80, -20:). An end may be a token's text, which is "
         "included: bank:loan. Positions count the tokens shown (after --words and "
         "--exclude-special).")]
QueriesOpt = Annotated[str | None, typer.Option(
    "--queries", rich_help_panel=VIEW_PANEL, metavar="A:B",
    help="The query rows to show, as --tokens (overrides it for rows); one token: 'it'.")]
KeysOpt = Annotated[str | None, typer.Option(
    "--keys", rich_help_panel=VIEW_PANEL, metavar="A:B",
    help="The key columns to show, as --tokens (overrides it for columns).")]


class LongDtype(str, Enum):
    """How ``--long`` stores queries and keys."""

    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


class ScaleName(str, Enum):
    """Colour scales of ``--scale``."""

    linear = "linear"
    power = "power"
    log = "log"


ScaleOpt = Annotated[ScaleName, typer.Option(
    "--scale", rich_help_panel=OUTPUT_PANEL,
    help="Colour scale: power (weight ** --gamma: small weights stay visible), linear, or log "
         "(three decades below the top).")]
GammaOpt = Annotated[float | None, typer.Option(
    "--gamma", min=0.05, max=5.0, rich_help_panel=OUTPUT_PANEL, show_default=False,
    help="Exponent of --scale power (default 0.5: lifts small weights; 1 is linear).")]
VmaxOpt = Annotated[str, typer.Option(
    "--vmax", rich_help_panel=OUTPUT_PANEL, metavar="auto|FLOAT",
    help="Weight drawn in the top colour: auto (the largest weight shown; the colour bar says "
         "it) or a number; --vmax 1 keeps the fixed 0..1 scale to compare figures.")]

# The toy model's options, shared by the capture options below and the analysis commands.
ToyHeadsOpt = Annotated[int, typer.Option("--toy-heads", min=1, rich_help_panel=TOY_PANEL,
                                          help="Attention heads per block.")]
ToyLayersOpt = Annotated[int, typer.Option("--toy-layers", min=1, rich_help_panel=TOY_PANEL,
                                           help="Stacked attention blocks.")]
DModelOpt = Annotated[int, typer.Option("--d-model", min=1, rich_help_panel=TOY_PANEL,
                                        help="Embedding width (a multiple of --toy-heads).")]
CausalOpt = Annotated[bool, typer.Option(
    "--causal", rich_help_panel=TOY_PANEL,
    help="Mask future tokens (-inf before the softmax), as in a decoder.")]
SeedOpt = Annotated[int, typer.Option("--seed", min=0, max=2**32 - 1, rich_help_panel=TOY_PANEL,
                                      help="Seed for weights and word embeddings.")]
NoScaleOpt = Annotated[bool, typer.Option(
    "--no-scale", rich_help_panel=TOY_PANEL,
    help="Drop the 1/sqrt(d_k) scaling to show how the softmax saturates.")]


@dataclass
class CaptureOptions:
    """What the shared capture options say; :meth:`request` turns them into the library's
    :class:`~attnviz.request.CaptureRequest`, which the command hands to the session."""

    text: str | None
    from_path: Path | None
    pair: str | None
    model: str | None
    revision: str | None
    trust_remote_code: bool
    device: str
    dtype: str
    toy_heads: int
    toy_layers: int
    d_model: int
    causal: bool
    seed: int
    no_scale: bool
    max_tokens: int | None
    truncate: bool
    no_cache: bool
    device_map: str | None = None
    server: str | None = None
    measure: str | None = None
    long: bool | None = None
    long_dtype: str = "float32"

    def __post_init__(self) -> None:
        self.long_dtype = str(getattr(self.long_dtype, "value", self.long_dtype))
        # --server (or $ATTNVIZ_SERVER) applies to the whole command: the CLI session becomes a
        # client of that server, so every capture the command asks for comes from there. A
        # saved capture (--from) is read here: no server is asked, whatever it says.
        use_server(self.server if self.from_path is None else None)
        self._check_toy_options()
        self._check_from_options()

    def _check_from_options(self) -> None:
        """Model and capture options given with --from do nothing (the saved capture is read
        as it was captured): say so (once)."""
        if self.from_path is None:
            return
        given = [flag for name, flag, default in _panel_options(MODEL_PANEL, TOY_PANEL)
                 if name not in ("server", "measure") and getattr(self, name) != default]
        if not given:
            return
        verb = "does" if len(given) == 1 else "do"
        message = (f"{', '.join(given)} {verb} nothing with --from: a saved capture is read "
                   "as it was captured (capture the text again to change it)")
        if message not in _WARNED:
            from rich.markup import escape

            _WARNED.add(message)
            warn(escape(message))

    def _check_toy_options(self) -> None:
        """Toy-model options given with another model do nothing: say so (once)."""
        from attnviz.models import TOY_MODEL

        given = [flag for name, flag, default in _toy_options()
                 if getattr(self, name) != default]
        if not given or self.from_path is not None or self.model_name == TOY_MODEL:
            return
        verb = "applies" if len(given) == 1 else "apply"
        message = (f"{', '.join(given)} only {verb} to --model toy; ignored for "
                   f"{self.model_name}")
        if given and message not in _WARNED:
            from rich.markup import escape

            _WARNED.add(message)
            warn(escape(message))

    @property
    def model_name(self) -> str:
        from attnviz.models import default_model

        if not self.model and _SERVER is not None:  # --server: that server's default model
            from attnviz.server.client import RemoteSession

            remote = session()
            if isinstance(remote, RemoteSession):
                return remote.default_model()
        return self.model or default_model()

    def spec(self) -> ModelSpec:
        """The model the options name, with its loading and toy options."""
        from attnviz.models import TOY_MODEL, ModelSpec

        name = self.model_name
        toy = None
        if name == TOY_MODEL:  # the toy module imports torch: only for the toy model
            from attnviz.models.toy import ToyConfig

            toy = ToyConfig(d_model=self.d_model, heads=self.toy_heads, layers=self.toy_layers,
                            causal=self.causal, scale=not self.no_scale, seed=self.seed)
        return ModelSpec(name=name, revision=self.revision,
                         trust_remote_code=self.trust_remote_code, device=self.device,
                         dtype=self.dtype, device_map=self.device_map, toy=toy)

    def request(self, *, layers: str | None = None, heads: str | None = None,
                layer: int | None = None, head: int | None = None,
                start_layer: int | None = None, long_path: bool = False) -> CaptureRequest:
        """The request for the command's TEXT (``-``: standard input) or ``--from`` capture.

        Args:
            layers: the layers to keep (``"0,2-4"``); ``heads`` the heads (``None``: all).
            layer: the layer the command reads, ``head`` its head (checked before loading
                and on the capture); ``start_layer`` rollout's first layer.
            long_path: the command can work on a long capture: ``--long`` forces it, and
                without ``--long``/``--no-long`` the session takes it when a full capture
                would not fit. Otherwise ``--long`` is refused.

        Raises:
            UsageError: neither or both of TEXT and ``--from``, ``--pair`` with ``--from``,
                or ``--long`` on a command without a long path.
        """
        if self.text is None and self.from_path is None:
            raise missing_text_error()
        if self.text is not None and self.from_path is not None:
            raise UsageError("give either TEXT or --from PATH, not both")
        if self.from_path is not None and self.pair is not None:
            raise UsageError("--pair cannot be used with --from: the capture already holds its "
                             "text")
        return self._request(layers=layers, heads=heads, layer=layer, head=head,
                             start_layer=start_layer, long_path=long_path)

    def model_request(self, *, layers: str | None = None, heads: str | None = None,
                      long_path: bool = False) -> CaptureRequest:
        """The request of a command whose texts come from elsewhere (``--input``, export's
        TEXT...): the model, the selection and the limits, no input of its own."""
        return self._request(layers=layers, heads=heads, input_given=False,
                             long_path=long_path)

    def long_choice(self, long_path: bool) -> bool | None:
        """The request's ``long``: ``--long``/``--no-long``, or ``None`` (decide by size) on a
        command with a long path; ``False`` on the others, which refuse ``--long``.

        Raises:
            UsageError: ``--long`` (or ``--long-dtype``) on a command without a long path.
        """
        if long_path:
            return self.long
        given = ("--long" if self.long else "--long-dtype" if self.long_dtype != "float32"
                 else None)
        if given is not None:
            raise UsageError(f"{given}: {_command_path()} has no long path (it needs every "
                             f"weight at once); --long works with "
                             f"{', '.join(LONG_COMMANDS)}",
                             f"leave out {given}, or shorten the input with --max-tokens N")
        return False

    def _request(self, *, input_given: bool = True, long_path: bool = False,
                 **what: Any) -> CaptureRequest:
        from attnviz.request import CaptureRequest

        long = self.long_choice(long_path)
        text = self.text if input_given else None
        from_path = self.from_path if input_given else None
        return CaptureRequest(text=None if text == "-" else text, stdin=text == "-",
                              from_path=from_path, pair=self.pair if input_given else None,
                              model=None if from_path is not None else self.spec(),
                              max_tokens=self.max_tokens, truncate=self.truncate,
                              use_cache=not self.no_cache, measure=self.measure, long=long,
                              long_dtype=self.long_dtype, **what)


# Model options: shared by the capture options below and by generate.
RevisionOpt = Annotated[str | None, typer.Option(
    "--revision", rich_help_panel=MODEL_PANEL,
    help="Hub branch, tag or commit of the model.")]
TrustRemoteCodeOpt = Annotated[bool, typer.Option(
    "--trust-remote-code", rich_help_panel=MODEL_PANEL,
    help="Allow the model's own Python code to run (off by default; only for models you "
         "trust).")]
DeviceOpt = Annotated[str, typer.Option(
    "--device", rich_help_panel=MODEL_PANEL,
    help="auto, cpu, cuda, cuda:N or mps (auto picks CUDA when present).")]
DtypeOpt = Annotated[str, typer.Option(
    "--dtype", rich_help_panel=MODEL_PANEL,
    help="float32, float16 or bfloat16 for the model; weights are returned as float32.")]
DeviceMapOpt = Annotated[str | None, typer.Option(
    "--device-map", rich_help_panel=MODEL_PANEL, metavar="MAP",
    help="'auto' spreads a model too big for one device over the GPUs, CPU memory and "
         "disk (Hugging Face Accelerate); use it instead of --device.")]
MaxTokensOpt = Annotated[int | None, typer.Option(
    "--max-tokens", min=1, rich_help_panel=MODEL_PANEL,
    help="Limit the input to this many tokens (a model's own limit always applies; the "
         "toy model's limit of 2048 can be raised).")]
TruncateOpt = Annotated[bool, typer.Option(
    "--truncate/--no-truncate", rich_help_panel=MODEL_PANEL,
    help="Past the token limit: keep the first tokens with a warning, or stop with an "
         "error.")]


_CAPTURE_PARAMS: list[tuple[str, Any, Any]] = [
    ("text", Annotated[str | None, typer.Argument(
        metavar="TEXT", show_default=False,
        help="The text to analyse; '-' reads standard input. Omit it when using --from.")], None),
    ("from_path", Annotated[Path | None, typer.Option(
        "--from", rich_help_panel=INPUT_PANEL, metavar="PATH",
        help="Re-use a saved capture (folder or .npy from 'attnviz dump') instead of TEXT.")],
     None),
    ("pair", Annotated[str | None, typer.Option(
        "--pair", rich_help_panel=INPUT_PANEL,
        help="Second sentence of a sentence pair (BERT-style [SEP] ... [SEP]).")], None),
    ("model", Annotated[str | None, typer.Option(
        "--model", "-m", rich_help_panel=MODEL_PANEL, show_default=False,
        help="'minilm' (bundled pretrained BERT, the default; $ATTNVIZ_MODEL overrides), 'toy', "
             "a Hugging Face model id or a local model folder.")], None),
    ("revision", RevisionOpt, None),
    ("trust_remote_code", TrustRemoteCodeOpt, False),
    ("device", DeviceOpt, "auto"),
    ("dtype", DtypeOpt, "float32"),
    ("device_map", DeviceMapOpt, None),
    ("measure", MeasureOpt, None),
    ("max_tokens", MaxTokensOpt, None),
    ("truncate", TruncateOpt, True),
    ("no_cache", Annotated[bool, typer.Option(
        "--no-cache", rich_help_panel=MODEL_PANEL,
        help="Do not read or write the capture cache.")], False),
    ("server", Annotated[str | None, typer.Option(
        "--server", envvar="ATTNVIZ_SERVER", rich_help_panel=MODEL_PANEL, metavar="URL",
        show_default=False,
        help="Capture through a running 'attnviz serve' at URL instead of loading the model "
             "here ($ATTNVIZ_SERVER); the numbers are the same.")], None),
    ("long", Annotated[bool | None, typer.Option(
        "--long/--no-long", rich_help_panel=LONG_PANEL, show_default=False,
        help="Long inputs (8k-100k+ tokens of a causal LM): capture each layer's queries, keys "
             "and log-sum-exp instead of every weight, and compute exact weights on demand "
             "(memory grows as tokens x head size, not tokens^2). Default: taken by itself "
             "when layers x heads x tokens^2 x 4 bytes is over $ATTNVIZ_MAX_FULL_MB (a quarter "
             "of the free memory); --no-long never.")], None),
    ("long_dtype", Annotated[LongDtype, typer.Option(
        "--long-dtype", rich_help_panel=LONG_PANEL,
        help="How the long path stores queries and keys (16-bit types halve the memory; "
             "weights are computed in float32).")], LongDtype.float32),
    ("toy_heads", ToyHeadsOpt, 2),
    ("toy_layers", ToyLayersOpt, 1),
    ("d_model", DModelOpt, 16),
    ("causal", CausalOpt, False),
    ("seed", SeedOpt, 0),
    ("no_scale", NoScaleOpt, False),
]


def _toy_options() -> list[tuple[str, str, Any]]:
    """``(field, option, default)`` of the toy-model options, from their declarations."""
    return _panel_options(TOY_PANEL)


def _panel_options(*panels: str) -> list[tuple[str, str, Any]]:
    """``(field, option, default)`` of the capture options shown under ``panels`` in the help,
    each by the name a user types to change it (``--model``, ``--no-truncate``)."""
    found = []
    for name, annotation, default in _CAPTURE_PARAMS:
        option = typing.get_args(annotation)[1]
        if getattr(option, "rich_help_panel", None) in panels:
            # In Annotated[...], typer keeps the first name as the option's "default".
            first = option.default
            names = ([first, *option.param_decls] if isinstance(first, str)
                     and first.startswith("-") else list(option.param_decls))
            flag = str(names[0])
            if "/" in flag:  # --truncate/--no-truncate: the one that is not the default
                flag = flag.split("/")[1 if default is True else 0]
            found.append((name, flag, default))
    return found


def capture_options(func: F) -> F:
    """Add the shared TEXT/--from/model options to a command.

    The command receives them as one ``options: CaptureOptions`` argument; its own parameters
    follow. Typer reads the combined signature, so ``--help`` lists every option.
    """
    import typing

    own_hints = typing.get_type_hints(func, include_extras=True)
    own = inspect.signature(func)
    own_params = [p.replace(annotation=own_hints.get(name, p.annotation))
                  for name, p in own.parameters.items() if name != "options"]
    shared = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                annotation=annotation)
              for name, annotation, default in _CAPTURE_PARAMS]
    text_param = shared[0].replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)
    # The command's own parameters are options: keyword-only, so required ones may follow TEXT.
    own_keyword = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own_params]
    params = [text_param, *own_keyword, *shared[1:]]
    shared_names = {name for name, _, _ in _CAPTURE_PARAMS}

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = inspect.Signature(params).bind(*args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        options = CaptureOptions(**{k: values.pop(k) for k in list(values) if k in shared_names})
        return func(options=options, **values)

    wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    hints = {name: annotation for name, annotation, _ in _CAPTURE_PARAMS}
    hints.update({k: v for k, v in own_hints.items() if k not in ("options", "return")})
    wrapper.__annotations__ = hints
    return wrapper  # type: ignore[return-value]


# --------------------------------------------------------------------------- getting a capture
def read_text(text: str) -> str:
    """The TEXT argument, with '-' read from standard input; rejects empty and NUL text."""
    from attnviz.request import check_text, read_stdin

    if text == "-":
        text = read_stdin()
    check_text(text)
    return text


def stdin_is_piped() -> bool:
    """Whether standard input is a pipe or a file (not a terminal): text may be waiting there."""
    import stat

    stream = sys.stdin
    if stream is None:
        return False
    try:
        mode = os.fstat(stream.fileno()).st_mode
        return stat.S_ISFIFO(mode) or stat.S_ISREG(mode)
    except (AttributeError, OSError, ValueError):  # no file descriptor (a test runner's stream)
        try:
            return not stream.isatty()
        except (AttributeError, ValueError):
            return False


def _command_path(default: str = "attnviz heatmap") -> str:
    """``attnviz heatmap`` etc.: the running command, for examples in messages."""
    import importlib

    # Recent Typer versions carry their own copy of click; older ones use click itself.
    for module in ("typer._click.globals", "click"):
        try:
            get_context = importlib.import_module(module).get_current_context
        except (ImportError, AttributeError):
            continue
        context = get_context(silent=True)
        if context is not None:
            return str(context.command_path)
    return default


def missing_text_error(what: str = "a TEXT to analyse or --from PATH with a saved capture"
                       ) -> UsageError:
    """The error for a command given no text; names ``-`` when text is waiting on a pipe."""
    command = _command_path()
    if stdin_is_piped():
        return UsageError(f"give {what}: standard input is not read unless TEXT is '-'",
                          f"use - to read standard input, e.g. echo \"The cat sat on the mat\" "
                          f"| {command} -")
    return UsageError(f"give {what}", f"example: {command} \"The cat sat on the mat\"")


_SESSION: Session | None = None
_WARNED: set[str] = set()  # warnings said once per process
_SERVER: str | None = None  # --server: the CLI session is a client of that attnviz serve


def use_server(url: str | None) -> None:
    """Send the CLI session's captures to ``attnviz serve`` at ``url`` (``None``: run here)."""
    global _SERVER, _SESSION
    url = url.strip() if url and url.strip() else None  # an empty $ATTNVIZ_SERVER: run here
    if url != _SERVER:
        _SERVER = url
        _SESSION = None


def session() -> Session:
    """The CLI's session: warnings on standard error, a spinner while a model loads; with
    ``--server``, a :class:`~attnviz.server.client.RemoteSession` of that server."""
    global _SESSION
    if _SESSION is None:
        if _SERVER is not None:
            from attnviz.server.client import RemoteSession

            _SESSION = RemoteSession(_SERVER, warn=warn, python=False)
            return _SESSION
        from attnviz.cli._steps import step
        from attnviz.session import Session

        _SESSION = Session(warn=warn, python=False, on_load=lambda name: stderr.status(
            f"Loading {name}...", spinner="dots"))
        # A long capture's forward pass, layer by layer (up to the last layer it records).
        _SESSION.long_progress = step(stderr, "forward pass", "layers")
    return _SESSION


def view_of(capture: Capture, *, exclude_special: bool = False, words: bool = False) -> Capture:
    """Apply --words and --exclude-special to a capture."""
    from attnviz.analysis.tokens import token_view

    return token_view(capture, words=words, exclude_special=exclude_special)
