"""Images of vision-language prompt rows: where each one comes from, its load-time check,
and its decoding.

A row's images (the ``data.image_field`` column, TRL's ``images``) are kept as
:class:`ImageSource` values: a file path (absolute, resolved against the data file's
directory when given relative) or the encoded bytes (a Parquet binary column, or the
``{"bytes": ...}`` mapping Hugging Face ``datasets`` writes). They are not decoded to pixels
in memory: :func:`check_images` opens and decodes every one once when the data loads, so a
missing, unreadable or oversized image, or a row whose ``{"type": "image"}`` placeholders
do not match its images, is refused then, naming the row and the image, rather than at the
step that draws it; :func:`open_image` decodes one when it is needed.

Pillow is imported only here and only when an image is opened (``pip install
'portarl[vision]'``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import warnings
from typing import Any, Iterable

#: Largest image :func:`check_images` accepts by default (width x height); larger ones are
#: refused as decompression bombs (Pillow's own default warns at about 89 million).
MAX_PIXELS_PER_IMAGE = 64_000_000


@dataclasses.dataclass(frozen=True)
class ImageSource:
    #: The image file (absolute, or as given when the data file's directory is unknown); None
    #: when ``data`` holds the image.
    path: str | None
    #: The encoded image (PNG, JPEG, ...); None when ``path`` names the file.
    data: bytes | None
    #: The row and image index (``data.jsonl:3 image 1``, counting from 0), for error messages.
    where: str = dataclasses.field(default="", compare=False)

    def __repr__(self) -> str:  # never the raw bytes in a log line
        held = repr(self.path) if self.path is not None else f"<{len(self.data or b'')} bytes>"
        return f"ImageSource({held}, where={self.where!r})"


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise ImportError("images need Pillow: pip install 'portarl[vision]'") from None
    return Image


def count_placeholders(prompt) -> int:
    """The number of ``{"type": "image"}`` parts in a conversation's message contents (0 for
    a plain string prompt or string contents)."""
    if isinstance(prompt, str):
        return 0
    return sum(1 for m in prompt if not isinstance(m["content"], str)
               for part in m["content"] if part.get("type") == "image")


def open_image(src: ImageSource):
    """The image as an RGB ``PIL.Image.Image``, fully decoded; its file is closed."""
    Image = _pil()
    with Image.open(src.path if src.data is None else io.BytesIO(src.data)) as im:
        im.load()
        return im.convert("RGB") if im.mode != "RGB" else im.copy()


@contextlib.contextmanager
def _pixel_limit(Image, max_pixels: int):
    """Pillow's decompression-bomb limit set to ``max_pixels`` (its warning an error) for the
    duration, and put back after."""
    before = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    finally:
        Image.MAX_IMAGE_PIXELS = before


def _name(src: ImageSource) -> str:
    return src.path if src.data is None else f"({len(src.data)} bytes)"


def _check_one(Image, src: ImageSource, max_pixels: int) -> None:
    """Open and decode ``src`` under :func:`_pixel_limit`: Pillow reads the size from the
    header and refuses an oversized image before decoding it."""
    if src.data is None and not os.path.isfile(src.path):
        raise ValueError(f"{src.where}: image file {src.path} does not exist")
    try:
        with Image.open(src.path if src.data is None else io.BytesIO(src.data)) as im:
            im.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise ValueError(f"{src.where}: image {_name(src)} has more than max_pixels_per_image={max_pixels} pixels "
                         f"(Pillow: {' '.join(str(err).split())}): a decompression bomb, or an image to shrink "
                         "first") from None
    except Exception as err:  # noqa: BLE001: Pillow's decoders raise OSError, SyntaxError, EOFError, ...
        raise _unreadable(src, err) from None


def _unreadable(src: ImageSource, err: Exception) -> ValueError:
    cause = " ".join(str(err).split()) or type(err).__name__
    return ValueError(f"{src.where}: image {_name(src)} cannot be read as an image "
                      f"({type(err).__name__}: {cause[:200]})")


def check_images(examples: Iterable[Any], *, max_pixels_per_image: int = MAX_PIXELS_PER_IMAGE,
                 image_field: str = "images") -> None:
    """Every example's ``{"type": "image"}`` placeholders match its images in number, and
    every image opens and decodes (Pillow's ``open`` and ``load``) with at most
    ``max_pixels_per_image`` pixels; otherwise one ``ValueError`` line naming the row (and
    the image). Run when the data loads."""
    Image = None
    for ex in examples:
        images = getattr(ex, "images", ())
        placeholders = count_placeholders(ex.prompt)
        if placeholders != len(images):
            raise ValueError(f"{ex.where}: row has {placeholders} image placeholder{'s' * (placeholders != 1)} but "
                             f"{len(images)} image{'s' * (len(images) != 1)} in column {image_field!r} (each "
                             "{\"type\": \"image\"} part of the prompt takes the next image of the column)")
        for src in images:
            if Image is None:
                Image = _pil()
            with _pixel_limit(Image, max_pixels_per_image):
                _check_one(Image, src, max_pixels_per_image)
