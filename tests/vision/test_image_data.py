"""Image data for vision-language prompts (issue 47), in TRL's format: ``{"type": "image"}``
placeholders in message contents, the images in the row's images column (paths relative to
the data file, Parquet bytes, or Hugging Face ``datasets``' ``{"bytes"}`` / ``{"path"}``
mappings), each checked and decoded once when the data loads, every fault one line naming
the row and the image."""

from __future__ import annotations

import base64
import io
import json
import re
import sys

import pytest

Image = pytest.importorskip("PIL.Image")

from portarl.assets.data import Example, is_empty_prompt, load_examples, write_jsonl  # noqa: E402
from portarl.trainer.config import ConfigError, TrainConfig  # noqa: E402
from portarl.vision.images import ImageSource, check_images, count_placeholders, open_image  # noqa: E402

ASK = [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]


def _png(path, colour="red", size=(32, 32)):
    Image.new("RGB", size, colour).save(path)
    return path


def _png_bytes(colour="blue", size=(32, 32), mode="RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, colour).save(out, format="PNG")
    return out.getvalue()


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _user(*parts):
    return [{"role": "user", "content": list(parts)}]


def test_jsonl_with_relative_paths_and_several_images_per_row(tmp_path):
    (tmp_path / "img").mkdir()
    _png(tmp_path / "img" / "a.png", "red")
    _png(tmp_path / "img" / "b.png", "green")
    _png(tmp_path / "c.png", "blue")
    data = _jsonl(tmp_path / "d.jsonl", [
        {"prompt": _user({"type": "image"}, {"type": "image"}, {"type": "text", "text": "Same?"}),
         "images": ["img/a.png", "img/b.png"], "answer": "no", "level": 2},
        {"prompt": _user(*ASK), "images": str(tmp_path / "c.png"), "answer": "blue"},  # one image, absolute
        {"prompt": "2+2=", "answer": "4"},  # no images column: a text row beside them
    ])
    first, second, third = load_examples(data)
    assert [im.path for im in first.images] == [str(tmp_path / "img" / "a.png"), str(tmp_path / "img" / "b.png")]
    assert [im.where for im in first.images] == [f"{data}:1 image 0", f"{data}:1 image 1"]
    assert first.columns == {"answer": "no", "level": 2}  # the images column is not handed to rewards
    assert first.prompt == ({"role": "user", "content": ({"type": "image"}, {"type": "image"},
                                                         {"type": "text", "text": "Same?"})},)
    assert second.images == (ImageSource(str(tmp_path / "c.png"), None, "anywhere"),)
    assert third.images == () and third.prompt == "2+2="
    assert [open_image(im).getpixel((0, 0)) for im in first.images + second.images] == [
        (255, 0, 0), (0, 128, 0), (0, 0, 255)]
    # relative to the data file, not to the working directory
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "d.jsonl").write_text(data.read_text())
    with pytest.raises(ValueError, match=re.escape(f"{other / 'd.jsonl'}:1 image 0: image file "
                                                   f"{other / 'img' / 'a.png'} does not exist")):
        load_examples(other / "d.jsonl")


def test_parquet_with_a_binary_column_and_with_path_strings(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    _png(tmp_path / "r.png", "red")
    prompts = [_user(*ASK), _user({"type": "text", "text": "Which two?"}, {"type": "image"}, {"type": "image"})]
    table = pa.table({"prompt": prompts,
                      "pics": pa.array([[_png_bytes("blue")], [_png_bytes("white"), _png_bytes("black", mode="L")]],
                                       type=pa.list_(pa.binary())),
                      "answer": ["blue", "white, black"]})
    pq.write_table(table, tmp_path / "b.parquet")
    rows = load_examples(tmp_path / "b.parquet", image_field="pics")
    assert [len(r.images) for r in rows] == [1, 2]
    assert rows[1].images[1].data == _png_bytes("black", mode="L") and rows[1].images[1].path is None
    assert rows[1].images[1].where == f"{tmp_path / 'b.parquet'} row 1 image 1"
    assert open_image(rows[1].images[1]).mode == "RGB"  # a grey image comes out RGB
    assert open_image(rows[0].images[0]).getpixel((5, 5)) == (0, 0, 255)
    assert "pics" not in rows[0].columns and rows[0].columns == {"answer": "blue"}
    # Parquet turns the parts into structs with the union of their keys: the nulls are ignored
    assert rows[1].prompt[0]["content"] == ({"type": "text", "text": "Which two?"}, {"type": "image"},
                                            {"type": "image"})

    pq.write_table(pa.table({"prompt": [prompts[0]], "images": [["r.png"]]}), tmp_path / "p.parquet")
    (row,) = load_examples(tmp_path / "p.parquet")
    assert row.images[0].path == str(tmp_path / "r.png")
    assert open_image(row.images[0]).getpixel((0, 0)) == (255, 0, 0)


def test_hugging_face_bytes_and_path_mappings(tmp_path):
    _png(tmp_path / "g.png", "green")
    encoded = base64.b64encode(_png_bytes("blue")).decode()
    data = _jsonl(tmp_path / "d.jsonl", [
        {"prompt": _user(*ASK, {"type": "image"}),
         "images": [{"bytes": encoded, "path": "ignored.png"}, {"bytes": None, "path": "g.png"}]},
    ])
    (row,) = load_examples(data)
    assert row.images[0].data == _png_bytes("blue") and row.images[0].path is None
    assert row.images[1].path == str(tmp_path / "g.png") and row.images[1].data is None
    # Parquet's struct form of datasets.Image: binary bytes, path beside them
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": [_user(*ASK)], "images": [[{"bytes": _png_bytes("blue"), "path": None}]]}),
                   tmp_path / "s.parquet")
    assert load_examples(tmp_path / "s.parquet")[0].images[0].data == _png_bytes("blue")
    _jsonl(data, [{"prompt": _user(*ASK), "images": [{"bytes": "not base64!"}]}])
    with pytest.raises(ValueError, match=re.escape(f"{data}:1 image 0: field 'images' \"bytes\" is not valid base64")):
        load_examples(data)
    _jsonl(data, [{"prompt": _user(*ASK), "images": [{"url": "http://x/y.png"}]}])
    with pytest.raises(ValueError, match=re.escape(f"{data}:1 image 0: field 'images' image must be a path string")):
        load_examples(data)


def test_write_jsonl_round_trips_images(tmp_path):
    _png(tmp_path / "a.png")
    encoded = base64.b64encode(_png_bytes()).decode()
    data = _jsonl(tmp_path / "d.jsonl", [
        {"prompt": _user(*ASK, {"type": "image"}), "images": ["a.png", {"bytes": encoded}], "answer": "red"},
        {"prompt": "1+1=", "answer": "2"},
    ])
    rows = load_examples(data)
    (tmp_path / "out").mkdir()
    write_jsonl(rows, tmp_path / "out" / "w.jsonl")  # another directory: the path is written absolute
    again = load_examples(tmp_path / "out" / "w.jsonl")
    assert again == rows
    assert [r.images for r in again] == [r.images for r in rows] and again[0].images != ()
    written = json.loads((tmp_path / "out" / "w.jsonl").read_text().splitlines()[0])
    assert written["images"] == [str(tmp_path / "a.png"), {"bytes": encoded}]
    assert "images" not in json.loads((tmp_path / "out" / "w.jsonl").read_text().splitlines()[1])


def test_a_text_only_dataset_is_unchanged(tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2", "level": 1},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
             "answer": 4, "tags": ["x"]}]
    data = _jsonl(tmp_path / "d.jsonl", rows)
    first, second = load_examples(data)
    assert first == Example("1+1=", "2") and first.columns == {"answer": "2", "level": 1} and first.images == ()
    assert second.prompt == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"})
    assert second.columns == {"answer": 4, "tags": ["x"]} and second.images == ()
    assert second.prompt_text == "system: Be brief.\nuser: 2+2?"


def test_text_rows_load_without_pillow_and_images_say_how_to_get_it(tmp_path, monkeypatch):
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    monkeypatch.setitem(sys.modules, "PIL", None)  # import PIL now raises ImportError
    assert load_examples(data)[0].prompt == "1+1="
    _png_path = tmp_path / "a.png"
    _png_path.write_bytes(b"")  # never opened: the import fails first
    _jsonl(data, [{"prompt": _user(*ASK), "images": ["a.png"]}])
    with pytest.raises(ImportError, match=re.escape("images need Pillow: pip install 'portarl[vision]'")):
        load_examples(data)


def test_prompt_text_and_placeholders():
    prompt = ({"role": "system", "content": "Look closely."},
              {"role": "user", "content": ({"type": "text", "text": "First "}, {"type": "image"},
                                           {"type": "text", "text": " then "}, {"type": "image"})})
    ex = Example(prompt, None)
    assert ex.prompt_text == "system: Look closely.\nuser: First <image> then <image>"
    assert count_placeholders(prompt) == 2 and count_placeholders("a <image> string") == 0
    assert count_placeholders(({"role": "user", "content": "text"},)) == 0
    # an image alone asks something; whitespace text alone does not
    assert not is_empty_prompt(({"role": "user", "content": ({"type": "image"},)},))
    assert is_empty_prompt(({"role": "system", "content": ({"type": "image"},)},
                            {"role": "user", "content": ({"type": "text", "text": " \n"},)}))


def _load_error(tmp_path, row, **kwargs) -> str:
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1="}, row])
    with pytest.raises(ValueError) as err:
        load_examples(data, **kwargs)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{data}:2"), message
    return message[len(f"{data}:2"):]


def test_image_faults_name_the_row_image_and_cause(tmp_path):
    _png(tmp_path / "ok.png")
    assert _load_error(tmp_path, {"prompt": _user(*ASK), "images": ["missing.png"]}) == (
        f" image 0: image file {tmp_path / 'missing.png'} does not exist")
    (tmp_path / "notes.png").write_text("these are notes, not pixels")
    assert re.fullmatch(rf" image 1: image {re.escape(str(tmp_path / 'notes.png'))} cannot be read as an image "
                        r"\(UnidentifiedImageError: .+\)",
                        _load_error(tmp_path, {"prompt": _user(*ASK, {"type": "image"}), "images": ["ok.png", "notes.png"]}))
    whole = _png_bytes(size=(64, 64))
    (tmp_path / "cut.png").write_bytes(whole[: len(whole) // 2])
    assert re.fullmatch(r" image 0: image .*cut.png cannot be read as an image \(OSError: .*truncated.*\)",
                        _load_error(tmp_path, {"prompt": _user(*ASK), "images": ["cut.png"]}))
    encoded = base64.b64encode(b"\x89PNG not really").decode()
    assert " image 0: image (15 bytes) cannot be read as an image" in _load_error(
        tmp_path, {"prompt": _user(*ASK), "images": [{"bytes": encoded}]})


def test_a_decompression_bomb_is_refused_and_the_pixel_limit_put_back(tmp_path):
    _png(tmp_path / "big.png", size=(40, 40))
    before = Image.MAX_IMAGE_PIXELS
    (ex,) = load_examples(_jsonl(tmp_path / "d.jsonl", [{"prompt": _user(*ASK), "images": ["big.png"]}]))
    # above the limit: Pillow warns (made an error here), above twice the limit it refuses;
    # either way one line naming the row, the image and the size, before any pixel is decoded
    for limit in (1000, 700):
        with pytest.raises(ValueError) as err:
            check_images([ex], max_pixels_per_image=limit)
        assert re.fullmatch(re.escape(f"{tmp_path / 'd.jsonl'}:1 image 0: image {tmp_path / 'big.png'} has more than "
                                      f"max_pixels_per_image={limit} pixels (Pillow: ") + r".*\b1600 pixels.*"
                            + re.escape("): a decompression bomb, or an image to shrink first"), str(err.value))
        assert Image.MAX_IMAGE_PIXELS == before
    check_images([ex], max_pixels_per_image=1600)  # at the limit: accepted
    with pytest.raises(ValueError, match=r"d.jsonl:1 image 0: .*more than max_pixels_per_image=1599 pixels"):
        check_images([ex], max_pixels_per_image=1599)
    assert Image.MAX_IMAGE_PIXELS == before


@pytest.mark.parametrize("placeholders, images, message", [
    (2, 1, "row has 2 image placeholders but 1 image in column 'images'"),
    (1, 2, "row has 1 image placeholder but 2 images in column 'images'"),
    (0, 1, "row has 0 image placeholders but 1 image in column 'images'"),
    (1, 0, "row has 1 image placeholder but 0 images in column 'images'"),
])
def test_placeholder_and_image_counts_must_match(tmp_path, placeholders, images, message):
    _png(tmp_path / "ok.png")
    parts = [{"type": "text", "text": "Look"}] + [{"type": "image"}] * placeholders
    row = {"prompt": _user(*parts)} | ({"images": ["ok.png"] * images} if images else {})
    assert _load_error(tmp_path, row) == f": {message} (each {{\"type\": \"image\"}} part of the prompt takes the " \
                                         "next image of the column)"


@pytest.mark.parametrize("content, message", [
    ([{"type": "image", "image": "cat.png"}],
     "field 'prompt' message 0 part 0: an image part is a placeholder {\"type\": \"image\"}; the image itself goes "
     "in the row's images column (data.image_field), not in key 'image'"),
    ([{"type": "image", "url": "http://x/cat.png"}], "not in key 'url'"),
    ([{"type": "text", "text": "hi"}, "plain string part"],
     "field 'prompt' message 0 part 1 must be {\"type\": \"text\", \"text\": str} or {\"type\": \"image\"}, "
     "got str"),
    ([{"type": "video"}], "field 'prompt' message 0 part 0: part type must be \"text\" or \"image\", got str"),
    ([{"text": "no type"}], "part type must be \"text\" or \"image\", got null"),
    ([{"type": "text", "text": 3}], "part 0: a text part needs \"text\": str, got int 3"),
    ([{"type": "text", "text": "hi", "lang": "en"}], "a text part has only \"type\" and \"text\", got key 'lang'"),
    ([], "field 'prompt' message 0 content must be a string or a non-empty list of"),
    (7, "field 'prompt' message 0 content must be a string or a non-empty list of"),
    (None, "field 'prompt' message 0 content must be a string or a non-empty list of"),
])
def test_content_parts_are_checked(tmp_path, content, message):
    assert message in _load_error(tmp_path, {"prompt": [{"role": "user", "content": content}]})


def test_an_images_column_value_of_the_wrong_kind(tmp_path):
    assert _load_error(tmp_path, {"prompt": _user(*ASK), "images": [3]}) == (
        " image 0: field 'images' image must be a path string, bytes, or {\"bytes\": base64} / {\"path\": str}, "
        "got int 3")
    assert _load_error(tmp_path, {"prompt": _user(*ASK), "images": [""]}) == (
        " image 0: field 'images' has an empty image path")


def test_image_field_config_is_validated_and_used(tmp_path):
    assert TrainConfig.load(None, []).data.image_field == "images"
    assert TrainConfig.load(None, ["data.image_field=pictures"]).data.image_field == "pictures"
    for value in ("prompt", "answer", "3", "''"):
        with pytest.raises(ConfigError, match="data.image_field must be a column name other than data.prompt_field "
                                              "and data.answer_field"):
            TrainConfig.load(None, [f"data.image_field={value}"])
    with pytest.raises(ConfigError, match="data.image_field must be"):
        TrainConfig.load(None, ["data.prompt_field=question", "data.image_field=question"])
    from portarl.assets.data import load_examples_for

    _png(tmp_path / "a.png")
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": _user(*ASK), "pictures": ["a.png"], "images": "kept"}])
    config = TrainConfig.load(None, [f"data.path={data}", "data.image_field=pictures"])
    (row,) = load_examples_for(config.data)
    assert row.images[0].path == str(tmp_path / "a.png") and row.columns == {"images": "kept"}
