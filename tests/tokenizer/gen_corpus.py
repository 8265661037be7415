#!/usr/bin/env python3
"""gen_corpus.py -- the tokenizer test corpus: >= 2,000 varied strings.

Deterministic (fixed seed).  Categories: prose in many scripts, source code
(spaces, tabs, CRLF), emoji with modifiers / ZWJ / flags / keycaps, runs of
white space and digits, look-alikes of the special tokens, control and
format characters, very long words, and random mixtures of code points.
Every character is assigned in this Python's Unicode database (14.0 on
Debian 12, the same version as PCRE2 10.42), so category-based rules agree.

    gen_corpus.py OUT.json      write a JSON list of strings
"""
import json
import random
import sys
import unicodedata

R = random.Random(20260)

PROSE = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you doing today?",
    "It's a well-known fact: don't trust y'all's \"quotes\" (or [brackets]).",
    "Pipeline parallelism in AI is a technique for training large models.",
    "Über die Brücke gehen Jürgen und Ökonomen; Straße, Maß, Fuß.",
    "Le cœur a ses raisons que la raison ne connaît point. Ça va? Où ça?",
    "¿Dónde está la biblioteca? ¡Está allí, señor Núñez!",
    "Съешь же ещё этих мягких французских булок да выпей чаю.",
    "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.",
    "الخط العربي فن جميل، وهو يكتب من اليمين إلى اليسار.",
    "עברית נכתבת מימין לשמאל, עם ניקוד: שָׁלוֹם.",
    "हिन्दी भाषा देवनागरी लिपि में लिखी जाती है।",
    "ภาษาไทยไม่มีการเว้นวรรคระหว่างคำ",
    "我们的模型支持中文，英文和代码。今天天气很好！",
    "繁體中文與簡體中文並存，電腦與电脑。",
    "日本語の文章はひらがな、カタカナ、漢字を混ぜて書きます。",
    "한국어는 한글로 씁니다. 안녕하세요!",
    "Tiếng Việt có nhiều dấu: Trường Đại học Bách khoa Hà Nội.",
    "Türkçe: İstanbul'da ığdır, şişli, çağlayan.",
    "ქართული ენა ძალიან ლამაზია.",
    "Հայերեն այբուբենը ստեղծել է Մեսրոպ Մաշտոցը։",
    "தமிழ் ஒரு பழமையான மொழி.",
    "বাংলা ভাষা খুব মিষ্টি।",
    "Ελληνικά και English mixed with 中文 and русский.",
    "naïve café résumé coöperate façade jalapeño",
    "e\u0301 a\u0308 o\u0302 n\u0303 (combining marks) \u1e9b\u0323",
    "ﬁ ﬂ ﬀ (ligatures) Ⅻ ½ ² ³ ⁴ (numbers of other kinds)",
    "ＡＢＣ　ｆｕｌｌｗｉｄｔｈ　１２３　！？",
    "“Smart quotes” ‘and’ — dashes – and … ellipses",
    "Price: $19.99, €5,00, £3.50, ¥1000, ₹250, 100%",
    "Emails: alice@example.com; URL: https://example.org/a/b?c=d&e=f#g",
]

CODE = [
    "def f(x):\n    return x * 2\n",
    "int\nmain(void)\n{\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "for (int i = 0; i < n; i++) {\n        a[i] += b[i];\n    }",
    "if __name__ == '__main__':\n    main()\n\n\n",
    "const x = {a: 1, b: [2, 3], c: \"d\"};\r\nconsole.log(x);\r\n",
    "<html>\n  <body>\n    <div class=\"x\">Hi</div>\n  </body>\n</html>",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "#!/bin/sh\nset -eu\nfor f in *.c; do\n\techo \"$f\"\ndone\n",
    "{\"key\": [1, 2.5, -3e10, true, null], \"nested\": {\"k\": \"v\"}}",
    "x=1;y=2;z=x+y  # comment\n\t\t\tindented with tabs",
    "    \n    \n        deeply   spaced    code    ",
    "std::vector<std::pair<int, std::string>> v{{1, \"a\"}};",
    "fn main() -> Result<(), Box<dyn Error>> { Ok(()) }",
    "a_b_c __init__ __dunder__ snake_case camelCase PascalCase",
    "x+=1;y-=2;z*=3;w/=4;v%=5;u**=6;t//=7;s<<=8;r>>=9",
    "#include <stdio.h>\n#define MAX(a, b) ((a) > (b) ? (a) : (b))\n",
    "$ echo 'hi' | grep -E \"h[i]+\" && ls -la ~/.config/",
    "@decorator\nclass A(B, metaclass=M):\n    '''doc'''\n    pass",
]

EMOJI = [
    "😀", "👍🏽", "👨‍👩‍👧‍👦", "🧑🏿‍🚀", "🏳️‍🌈", "🇫🇷🇯🇵🇺🇸", "1️⃣2️⃣#️⃣",
    "❤️", "✌🏻", "👩‍❤️‍💋‍👨", "🐈‍⬛", "🫠", "😶‍🌫️", "🤷‍♀️", "👁️‍🗨️",
    "☕", "⚽️", "🏴󠁧󠁢󠁳󠁣󠁴󠁿",
]

SPECIAL = [
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
    "<｜Assistant｜>", "<think>", "</think>", "<｜▁pad▁｜>", "｜DSML｜",
    "<｜tool▁calls▁begin｜>", "<｜fim▁hole｜>", "<dsml:", "</dsml:",
    "<｜latest_reminder｜>",
]
LOOKALIKE = [
    "<｜User", "<｜User｜", "｜User｜>", "<|User|>", "<| User |>", "<｜user｜>",
    "<Think>", "< think>", "</think >", "<think", "think>", "<<think>>",
    "<｜begin_of_sentence｜>", "<｜begin▁of▁sentence|>", "<｜｜>", "<｜",
    "｜>", "▁", "▁▁▁", "<｜User｜><｜Assistant｜>", "<<｜User｜>>",
    "</think></think>", "<think><think>", "<｜User｜｜>", "<dsml:x>",
]

CONTROL = [chr(c) for c in range(0, 32)] + ["\x7f", "\x85", "\u200b",
    "\u200c", "\u200d", "\ufeff", "\u2028", "\u2029", "\u00a0", "\u3000",
    "\u2009", "\u202f", "\u180e", "\u00ad", "\u2060", "\ufffd"]

WS = [" ", "\t", "\n", "\r", "\r\n", "\u00a0", "\u3000", "\u2003", "\x0b",
      "\x0c", "\x1c", "\x1f", "\x85"]

WORDS = ["the", "model", "token", "数据", "данные", "λόγος", "x", "I", "é",
         "hello", "World", "123", "4567", "π", "_", "--", "...", "!?", "'s",
         "n't", "ab", "の", "ー", "ア", "한", "🙂", "\u0301", "ß", "ǅ"]


def pick_chars():
    """Assigned characters from a spread of planes and blocks."""
    ranges = [(0x20, 0x7e), (0xa0, 0x24f), (0x300, 0x36f), (0x370, 0x3ff),
              (0x400, 0x4ff), (0x590, 0x6ff), (0x900, 0x97f), (0xe00, 0xe7f),
              (0x1100, 0x11ff), (0x2000, 0x206f), (0x2070, 0x209f),
              (0x20a0, 0x20bf), (0x2100, 0x214f), (0x2150, 0x218f),
              (0x2190, 0x23ff), (0x2460, 0x24ff), (0x2500, 0x27bf),
              (0x3000, 0x303f), (0x3040, 0x30ff), (0x4e00, 0x9fff),
              (0xac00, 0xd7a3), (0xf900, 0xfaff), (0xfe30, 0xfe4f),
              (0xff00, 0xffef), (0x10000, 0x1007f), (0x1d400, 0x1d7ff),
              (0x1f300, 0x1faff), (0x20000, 0x2a6df)]
    out = []
    for lo, hi in ranges:
        for c in range(lo, hi + 1):
            ch = chr(c)
            if unicodedata.category(ch) not in ("Cn", "Cs", "Co"):
                out.append(ch)
    return out


def main():
    out = []
    add = out.append
    for s in PROSE + CODE + EMOJI + SPECIAL + LOOKALIKE + CONTROL:
        add(s)
    # Prose variations: leading/trailing space, joined, case changes.
    for s in PROSE:
        add(" " + s)
        add(s + " ")
        add(s.upper())
        add(s.lower() + "\n")
        add(s.replace(" ", "  "))
        add(s.replace(" ", "\t"))
        add(s.replace(" ", "\n"))
    # Code variations: CRLF, tabs <-> spaces, deeper indents.
    for s in CODE:
        add(s.replace("\n", "\r\n"))
        add(s.replace("    ", "\t"))
        add(s.replace("\n", "\n" + " " * R.randint(1, 16)))
        add(s * 3)
    # Emoji in text and in runs.
    for e in EMOJI:
        add("I like " + e + " a lot" + e + e)
        add(e * R.randint(2, 7))
        add(e + " " + e + "\n" + e)
    # White-space runs around words.
    for n in list(range(1, 41)) + [64, 100, 257, 1000]:
        for w in WS:
            add("a" + w * n + "b")
        add(" " * n)
        add("x" + " " * n)
        add(" " * n + "x")
        add("\n" * n)
        add("\t" * n + "y")
        add(" \n" * n)
        add("word" + " " * n + "\n" + " " * n + "word")
    for _ in range(150):
        add("".join(R.choice(WS) for _ in range(R.randint(1, 30))) +
            R.choice(WORDS) +
            "".join(R.choice(WS) for _ in range(R.randint(0, 12))) +
            R.choice(WORDS))
    # Digit runs, several numbering systems.
    digits = ["0123456789", "٠١٢٣٤٥٦٧٨٩", "０１２３４５６７８９", "०१२३४५६७८९",
              "²³¹¼½¾", "ⅠⅡⅢⅣⅤ", "①②③"]
    for n in list(range(1, 31)) + [50, 99, 100, 333, 1000]:
        d = digits[n % len(digits)]
        run = "".join(R.choice(d) for _ in range(n))
        add(run)
        add("v" + run + "x")
        add(run + " " + run)
        add("3." + run)
        add("-" + run + "e10")
    for _ in range(60):
        add(",".join(str(R.randint(0, 10 ** R.randint(1, 12)))
                     for _ in range(R.randint(1, 8))))
    # Special tokens and look-alikes inside text.
    for s in SPECIAL + LOOKALIKE:
        add("text" + s + "more")
        add(" " + s + " ")
        add(s + s)
        add("\n" + s + "\n\n")
        add("中文" + s + "😀")
    for _ in range(100):
        add("".join(R.choice(SPECIAL + LOOKALIKE + WORDS + [" ", "\n"])
                    for _ in range(R.randint(2, 12))))
    # Control characters between and inside words.
    for c in CONTROL:
        add("a" + c + "b")
        add(c * 3 + "word" + c)
        add("x " + c + " y")
        add(c + "\n" + c)
    # Very long words.
    for n in [100, 500, 2000, 5000]:
        add("a" * n)
        add("ab" * (n // 2))
        add("".join(R.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n)))
        add("中" * (n // 4) + "国" * (n // 4))
        add("https://example.com/" + "x/" * (n // 10) + "?q=" + "9" * 20)
        add("".join(R.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijkl"
                             "mnopqrstuvwxyz0123456789+/") for _ in range(n)))
        add("=" * (n // 5))
        add("é" * (n // 5))
        add("Straße" * (n // 20))
    # Random mixtures of words and separators.
    for _ in range(400):
        add("".join(R.choice(WORDS + WS + SPECIAL[:3] + list(",.;:!?()[]"))
                    for _ in range(R.randint(1, 25))))
    # Random code points from many blocks.
    chars = pick_chars()
    for _ in range(400):
        add("".join(R.choice(chars) for _ in range(R.randint(1, 40))))
    for _ in range(100):
        add("".join(R.choice(chars) + R.choice(WS) for _ in range(
            R.randint(1, 20))))
    # Drop exact duplicates, keep order; never an empty string list.
    seen = set()
    uniq = []
    for s in out:
        if s not in seen:
            seen.add(s)
            uniq.append(s)
    assert len(uniq) >= 2000, len(uniq)
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        json.dump(uniq, f, ensure_ascii=True)


if __name__ == "__main__":
    main()
