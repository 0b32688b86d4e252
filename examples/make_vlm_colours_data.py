"""Draws the images and writes the data of examples/vlm-colours.yaml: "Which colour is the
square?" over a coloured square drawn at a random place and size on a grey background.

    python examples/make_vlm_colours_data.py   # -> examples/data/vlm_colours{,_eval}.jsonl and its PNGs

Four colours (red, green, blue, yellow), 48 training rows and 24 held-out evaluation rows,
seeded. Each row is TRL's conversational format: a user message whose content is an image
part and a text part, the image's path (relative to the data file) in the ``images``
column, and the colour as ``answer``. 56 x 56 pixels: with the tiny models' processors
(min_pixels 4 x 28 x 28) that is 4 image tokens per image.
"""

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (40, 60, 220), "yellow": (235, 215, 20)}
QUESTION = "Which colour is the square?"
SIZE = 56


def draw(colour: str, rng: random.Random) -> Image.Image:
    grey = rng.randint(90, 170)
    image = Image.new("RGB", (SIZE, SIZE), (grey, grey, grey))
    side = rng.randint(20, 40)
    x, y = rng.randint(0, SIZE - side), rng.randint(0, SIZE - side)
    ImageDraw.Draw(image).rectangle([x, y, x + side - 1, y + side - 1], fill=COLOURS[colour])
    return image


def write(path: Path, count: int, rng: random.Random, tag: str) -> None:
    images = path.parent / "vlm_colours_images"
    images.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(count):
            colour = list(COLOURS)[i % len(COLOURS)]
            name = f"{tag}_{i:03d}.png"
            draw(colour, rng).save(images / name, optimize=True)
            prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
            f.write(json.dumps({"prompt": prompt, "images": [f"vlm_colours_images/{name}"], "answer": colour}) + "\n")


def main() -> None:
    out = Path(__file__).parent / "data"
    rng = random.Random(0)
    write(out / "vlm_colours.jsonl", 48, rng, "train")
    write(out / "vlm_colours_eval.jsonl", 24, rng, "eval")


if __name__ == "__main__":
    main()
