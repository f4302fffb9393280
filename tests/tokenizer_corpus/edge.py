"""Hand-written inputs aimed at the traps a Unigram tokenizer can fall into, plus a
seeded random mix of those characters."""

from __future__ import annotations

import random

__all__ = ["edge_cases"]

# Characters the normalizer, the pre-tokenizer or the special-token matcher treat specially.
_TRICKY = [
    " ",
    "  ",
    "\t",
    "\n",
    "\r",
    "\r\n",
    "\u0085",
    "\u00a0",
    "\u3000",
    "\u2002",
    "\u200b",
    "\u200c",
    "\u200d",
    "\u2060",
    "\ufeff",
    "\x00",
    "\x01",
    "\x1f",
    "\x7f",
    "\u0301",
    "\u0308",
    "\u0327",
    "e\u0301",
    "ｆ",
    "Ａ",
    "１",
    "！",
    "＜",
    "＞",
    "ｶ",
    "ﾞ",
    "½",
    "ﬁ",
    "㍿",
    "Ⅻ",
    "▁",
    "👍",
    "👍🏽",
    "👨‍👩‍👧",
    "🇫🇷",
    "🏳️‍🌈",
    "<s>",
    "</s>",
    "<pad>",
    "<unk>",
    "<mask>",
    "<",
    ">",
    "a",
    "Z",
    "é",
    "ß",
    "ı",
    "İ",
    "ŉ",
    "ǅ",
    "日",
    "本",
    "語",
    "한",
    "ㄱ",
    "ا",
    "ל",
    "क",
    "ि",
    "्",
    "ष",
    "ก",
    "ำ",
    "\U0001d400",
    "\U00020000",
    "\ud7a3",
    ".",
    ",",
    "'",
    "-",
    "_",
]


def _random_mix(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(1, 24)
        out.append("".join(rng.choice(_TRICKY) for _ in range(k)))
    return out


def edge_cases(long_doc: str = "") -> list[str]:
    """Named traps first, then 3,000 random mixes; `long_doc` (a ~16k-token document) is
    appended when given."""
    cases = [
        "",
        " ",
        "   ",
        "\t",
        "\n",
        "a",
        "Hello, my dog is cute",
        "  leading and trailing  ",
        "many     spaces   between\twords",
        "tabs\tand\nnewlines\r\nand\rcarriage returns",
        "\r\n\r\n",
        "next line\u0085here",
        "no\u00a0break\u00a0space",
        "ideographic\u3000space\u3000\u3000twice",
        "zero\u200bwidth\u200cnon\u200djoiner\ufeffbom\u2060wj",
        "control\x00nul\x01soh\x1fus\x7fdel",
        "combining e\u0301 and a\u0308 and c\u0327 stacked a\u0301\u0302\u0303\u0304\u0305",
        "NFD: Cafe\u0301 Zu\u0308rich Ame\u0301lie",
        "full-width: ＨＥＬＬＯ　ｗｏｒｌｄ！ １２３ ｶﾀｶﾅ",
        "ligatures ﬁﬂ ﬀ, fractions ½ ¾, squares ㍿ ㎏, roman Ⅻ",
        "emoji 👍👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇩🇪🇯🇵 rainbow 🏳️‍🌈 keycap 1️⃣",
        "<s>literal</s> specials <pad> and <unk> and <mask> inside",
        "x<mask>y  <mask>  z<mask>",
        "<s><s></s></s>",
        "＜unk＞ and ＜s＞ look like specials after normalization",
        "unknown chars: \U0001d400\U0001d401 \U00020000\U00020001 \ud7a3\U0010fffd",
        "supercalifragilisticexpialidocious" * 3,
        "Donaudampfschifffahrtsgesellschaftskapitänsmützenabzeichenhersteller",
        "日本語のテキストはスペースなしで長く続きます" * 6,
        "ｱｲｳｴｵ" * 20,
        "▁already▁has▁metaspace ▁▁",
        "a" * 300,
        "🙂" * 100,
        "\u0301leading combining mark",
        "a\u0301" * 50,
        "Ελληνικά, русский, עברית, العربية, हिन्दी, ไทย, 한국어, 中文",
    ]
    cases += _random_mix(3000, seed=5)
    if long_doc:
        cases.append(long_doc)
    return cases
