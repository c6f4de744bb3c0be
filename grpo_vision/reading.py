"""Reading the files a user, a run folder or another model's output hands us: refused in one line, never
waited on forever or crashed by.

Any path may be something other than the file it names: a FIFO (open() waits for a writer that never
comes), a folder, a device; a JSON line nested 100,000 deep (Python's parser: RecursionError), bytes that
are not UTF-8, a 420 KB PNG that declares 12000 x 12000 pixels (decoding it took 18 GB). Every reader of
such a file goes through here, and gets `error`, the caller's own error class (LayoutError, PromptsError,
FolderError, ...), with a message naming the file, the line where there is one, and the fix.
"""

from __future__ import annotations

import json
import os
import stat
import warnings
from pathlib import Path

# Lists and objects one JSON value may nest. Python's parser stops near 1,000 with a RecursionError, and
# a value a few hundred deep parses but breaks json.dumps (a run saves its prompts) and copies
MAX_DEPTH = 100
# Pixels an image may declare before it is decoded: a decoded pixel costs 3 bytes, and 15 once it is a float
# tensor, so 4096 x 4096 is about 250 MB. GenEval's images are 512 x 512 or 1024 x 1024. PIL's own bomb
# check only refuses past 179 million pixels (2 x Image.MAX_IMAGE_PIXELS); 144 million took 18 GB here.
MAX_PIXELS = 4096 * 4096
PIXELS_ENV = "GRPO_VISION_MAX_PIXELS"  # a larger (or smaller) limit, for larger images on a larger machine

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def what_is(path: str | Path) -> str | None:
    """None when `path` is a regular file (through a link: what it points to); else what it is: 'missing',
    'a folder', 'a FIFO (named pipe)', ... Only stat()s: never opens it."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # NotADirectoryError: a part of the path is a file
        return "missing"
    except OSError as e:  # a folder on the way that may not be searched, a link that loops
        return f"out of reach ({e.strerror})"
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def regular_file(path: str | Path, error: type[Exception], fix: str) -> Path:
    """`path` when it is a regular file; else `error` saying what it is (missing, a folder, a FIFO, ...) and `fix`."""
    kind = what_is(path)
    if kind == "missing":
        raise error(f"{path} not found: {fix}")
    if kind:
        raise error(f"{path} is {kind}, not a file: {fix}")
    return Path(path)


def read_bytes(path: str | Path, error: type[Exception], fix: str) -> bytes:
    """The bytes of the regular file `path` (`regular_file`); `error` when it cannot be read."""
    regular_file(path, error, fix)
    try:
        # O_NONBLOCK: a FIFO swapped in since the check above opens at once (and is refused below), never waits
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise error(f"{path} cannot be read ({e.strerror}): {fix}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(f"{path} is not a regular file: {fix}")
        try:
            return f.read()
        except OSError as e:
            raise error(f"{path} cannot be read ({e.strerror}): {fix}") from None


def read_text(path: str | Path, error: type[Exception], fix: str) -> str:
    """The UTF-8 text of the regular file `path`, a leading byte-order mark dropped and line breaks ("\\r\\n",
    "\\r") read as "\\n", as open() reads text; `error` naming the line of a byte that is not UTF-8."""
    data = read_bytes(path, error, fix)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise error(f"{path} is not UTF-8 text (line {line}: byte 0x{data[e.start]:02x}); save it as UTF-8") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def json_value(text: str, where: str, error: type[Exception], max_depth: int = MAX_DEPTH):
    """The JSON value in `text`; `error` naming `where` when it is not JSON or nests more than `max_depth`
    lists and objects."""
    too_deep = f"{where}: lists and objects nested more than {max_depth} levels deep; write flatter JSON"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:  # nested far past max_depth: the parser stopped at Python's recursion limit
        raise error(too_deep) from None
    if depth(value) > max_depth:
        raise error(too_deep)
    return value


def depth(value) -> int:
    """How many levels of lists and objects `value` nests, counted level by level, without recursion."""
    n, level = 0, [value]
    while level := [v for v in level if isinstance(v, (list, dict))]:
        n += 1
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v)]
    return n


class _Skipped(ValueError):
    pass


def json_lines(path: str | Path, error: type[Exception], fix: str
               ) -> tuple[list[tuple[int, object]], list[tuple[int, str]]]:
    """A JSON-lines log (metrics.jsonl): (line number, value) of each line that reads, and (line number,
    "<file>, line N: why") of each other non-blank line (not UTF-8, not JSON: a line cut short by a crash,
    nested too deep), for the caller to skip or name. `error` only when the file itself cannot be read."""
    values, skipped = [], []
    for number, raw in enumerate(read_bytes(path, error, fix).split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            skipped.append((number, f"{path}, line {number}: not UTF-8 text (byte 0x{raw[e.start]:02x})"))
            continue
        try:
            values.append((number, json_value(text, f"{path}, line {number}", _Skipped)))
        except _Skipped as e:
            skipped.append((number, str(e)))
    return values, skipped


def max_pixels(error: type[Exception]) -> int:
    """The most pixels an image may declare: $GRPO_VISION_MAX_PIXELS, else MAX_PIXELS."""
    text = os.environ.get(PIXELS_ENV, "").strip()
    if not text:
        return MAX_PIXELS
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        value = 0
    if value < 1:
        raise error(f"{PIXELS_ENV}={text[:40]!r}: expected a whole number of pixels >= 1 (default {MAX_PIXELS})")
    return value


def image_size(path: str | Path, error: type[Exception]) -> tuple[int, int]:
    """(width, height) that the image file `path` declares, read from its header without decoding it; `error`
    when it is not a regular file, not an image PIL reads, or declares more than `max_pixels` pixels."""
    from PIL import Image, UnidentifiedImageError

    regular_file(path, error, "put an image file there")
    limit = max_pixels(error)
    try:
        with warnings.catch_warnings():  # PIL warns past 89 million pixels; the limit below says it in one line
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as img:  # reads the header only: no pixel is decoded here
                width, height = img.size
    except Image.DecompressionBombError:  # PIL refuses at open past twice its MAX_IMAGE_PIXELS
        raise error(f"{path} declares more than {2 * Image.MAX_IMAGE_PIXELS} pixels, which PIL refuses to decode "
                    f"(a decompression bomb); resize the image") from None
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as e:  # PIL's parsers raise all of these
        raise error(f"{path}: not a readable image ({e})") from None
    if width * height > limit:
        raise error(f"{path} declares {width} x {height} pixels, more than the {limit} an image may have before it "
                    f"is decoded ({PIXELS_ENV}, default {MAX_PIXELS} = 4096 x 4096): resize the image, or set "
                    f"{PIXELS_ENV} to a larger number on a machine with the memory")
    return width, height
