import pytest

from griffin.data.sources import default_corpus_files, iter_documents, valid_utf8


def test_iter_documents_walks_directories(tmp_path):
    (tmp_path / "b.txt").write_text("bee")
    (tmp_path / "a.md").write_text("ay")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / ".hidden.txt").write_text("hidden")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "x.txt").write_text("git")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.jsonl").write_text('{"text": "c1"}\n\n{"text": "c2", "id": 2}\n{"text": ""}\n')
    (tmp_path / "sub" / "d.json").write_text('{"body": "d1"}\n')
    (tmp_path / "raw.bin").write_bytes(b"caf\xc3\xa9 \xff")
    assert list(iter_documents([tmp_path / "sub" / "c.jsonl"])) == ["c1", "c2"]
    assert list(iter_documents([tmp_path / "sub" / "d.json"], text_field="body")) == ["d1"]
    with pytest.raises(ValueError, match=r"d\.json:1: no field 'text'"):
        list(iter_documents([tmp_path]))
    (tmp_path / "sub" / "d.json").unlink()
    assert list(iter_documents([tmp_path])) == ["ay", "bee", "c1", "c2"]  # sorted, hidden and .png skipped
    # a file named explicitly is read whatever its suffix, undecodable bytes kept as surrogate escapes
    (raw,) = iter_documents([tmp_path / "raw.bin"])
    assert raw.encode("utf-8", "surrogateescape") == b"caf\xc3\xa9 \xff"


def test_iter_documents_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.txt"):
        list(iter_documents([tmp_path / "nowhere.txt"]))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not a JSON object"):
        list(iter_documents([tmp_path / "bad.jsonl"]))
    (tmp_path / "bad.jsonl").write_text('{"text": 3}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: field 'text' is int"):
        list(iter_documents([tmp_path / "bad.jsonl"]))
    (tmp_path / "bad.jsonl").unlink()
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(ValueError, match="no documents.*empty.txt"):
        list(iter_documents([tmp_path / "empty.txt", tmp_path / "empty.jsonl"]))
    with pytest.raises(ValueError, match=f"no documents.*{tmp_path.name}"):
        list(iter_documents([tmp_path]))


def test_default_corpus_files():
    files = default_corpus_files()
    assert files == sorted(files) == default_corpus_files()
    names = {f.name for f in files}
    assert {"os.py", "argparse.py", "__init__.py"} <= names
    assert all(f.suffix == ".py" for f in files)
    excluded = {"site-packages", "dist-packages", "test", "tests", "idlelib"}
    assert not any(excluded & set(f.parts) for f in files)


def test_valid_utf8():
    assert valid_utf8("plain ascii") == "plain ascii"
    assert valid_utf8("état 日本 🙂") == "état 日本 🙂"
    raw = b"caf\xc3\xa9 \xff\xfe end".decode("utf-8", "surrogateescape")
    assert valid_utf8(raw) == "café \ufffd\ufffd end"
    valid_utf8(raw).encode("utf-8")  # encodable


def test_split_pieces_cuts_at_blank_lines_then_line_ends():
    from griffin.data.sources import split_pieces

    text = "".join(f"paragraph {i}\nsecond line\n\n" for i in range(40))
    pieces = list(split_pieces([text, "short"], 100))
    assert "".join(pieces[:-1]) == text and pieces[-1] == "short"
    assert all(len(p) <= 100 for p in pieces) and all(p.endswith("\n\n") for p in pieces[:-2])
    lines = "x" * 30 + "\n" + "y" * 90
    assert list(split_pieces([lines], 60)) == ["x" * 30 + "\n", "y" * 60, "y" * 30]  # no blank line, a line end

