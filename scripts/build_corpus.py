"""Rebuild the bundled sample corpus, pitstop/assets/kjv_chapters.jsonl.gz.

Source: the King James Version of the Bible as packaged by Debian
(`apt-get install bible-kjv`, which pulls in `bible-kjv-text`). The text is in
the public domain, so it may be shipped. One JSON record per chapter
(`{"text": ..., "book": ..., "chapter": ...}`): 1,189 documents whose lengths run
from two verses (Psalm 117) to 176 (Psalm 119) -- the long-tailed length
distribution that makes padding expensive.

Run: python scripts/build_corpus.py  (needs the `bible` command on PATH)
"""

from __future__ import annotations

import gzip
import json
import re
import subprocess
from pathlib import Path

# Debian's `bible` accepts these names; the number is the book's chapter count.
BOOKS = [
    ("Genesis", 50), ("Exodus", 40), ("Leviticus", 27), ("Numbers", 36),
    ("Deuteronomy", 34), ("Joshua", 24), ("Judges", 21), ("Ruth", 4),
    ("1Samuel", 31), ("2Samuel", 24), ("1Kings", 22), ("2Kings", 25),
    ("1Chronicles", 29), ("2Chronicles", 36), ("Ezra", 10), ("Nehemiah", 13),
    ("Esther", 10), ("Job", 42), ("Psalms", 150), ("Proverbs", 31),
    ("Ecclesiastes", 12), ("Song", 8), ("Isaiah", 66), ("Jeremiah", 52),
    ("Lamentations", 5), ("Ezekiel", 48), ("Daniel", 12), ("Hosea", 14),
    ("Joel", 3), ("Amos", 9), ("Obadiah", 1), ("Jonah", 4), ("Micah", 7),
    ("Nahum", 3), ("Habakkuk", 3), ("Zephaniah", 3), ("Haggai", 2),
    ("Zechariah", 14), ("Malachi", 4), ("Matthew", 28), ("Mark", 16),
    ("Luke", 24), ("John", 21), ("Acts", 28), ("Romans", 16),
    ("1Corinthians", 16), ("2Corinthians", 13), ("Galatians", 6),
    ("Ephesians", 6), ("Philippians", 4), ("Colossians", 4),
    ("1Thessalonians", 5), ("2Thessalonians", 3), ("1Timothy", 6),
    ("2Timothy", 4), ("Titus", 3), ("Philemon", 1), ("Hebrews", 13),
    ("James", 5), ("1Peter", 5), ("2Peter", 3), ("1John", 5), ("2John", 1),
    ("3John", 1), ("Jude", 1), ("Revelation", 22),
]  # fmt: skip

DISPLAY = {"Song": "Song of Solomon"}
VERSE = re.compile(r"^\S+?(\d+):(\d+)\s+(.*)$")


def chapter_text(book: str, chapter: int) -> list[str]:
    out = subprocess.run(
        ["bible", "-f", f"{book}{chapter}:1-999"], capture_output=True, text=True, check=True
    ).stdout
    verses = []
    for line in out.splitlines():
        m = VERSE.match(line.strip())
        if m and int(m.group(1)) == chapter:
            verses.append(f"{m.group(2)} {m.group(3).strip()}")
    return verses


def main() -> None:
    dest = Path(__file__).resolve().parent.parent / "pitstop" / "assets" / "kjv_chapters.jsonl.gz"
    n = 0
    with gzip.GzipFile(dest, "wb", mtime=0) as raw:
        for book, chapters in BOOKS:
            name = DISPLAY.get(book, book.replace("1", "1 ").replace("2", "2 ").replace("3", "3 "))
            for c in range(1, chapters + 1):
                verses = chapter_text(book, c)
                if not verses:
                    raise SystemExit(f"no verses for {book} {c}")
                text = f"{name} {c}\n\n" + "\n".join(verses)
                rec = {"text": text, "book": name, "chapter": c}
                raw.write((json.dumps(rec, ensure_ascii=False) + "\n").encode())
                n += 1
    print(f"wrote {n} chapters to {dest}")


if __name__ == "__main__":
    main()
