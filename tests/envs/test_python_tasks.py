"""The bundled python_tests tasks grade what they say: their hidden cases are the
reference's answers, hold the public example, and fail wrong solutions a policy finds
(checked on the host by calling the functions; the sandbox path is test_verifier's)."""

import copy

import pytest

from envs.python_tasks_data import TASKS, _function_name
from envs.values import strict_equal

BY_NAME = {t[0]: t for t in TASKS}

# Wrong solutions that passed the hidden cases (red team: the first five; two of them
# even failed the public test shown in the prompt), and other near misses.
WRONG = {
    "leap_year": ["def is_leap(y):\n    return y % 400 == 0\n",
                  "def is_leap(y):\n    return y % 4 == 0\n",
                  "def is_leap(y):\n    return y % 4 == 0 and y % 100 != 0\n"],
    "count_vowels": ["def count_vowels(s):\n    return sum(c in 'AEIOU' for c in s)\n",
                     "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)\n"],
    "second_largest": ["def second_largest(xs):\n    s = sorted(set(xs))\n"
                       "    return s[0] if len(s) >= 2 else None\n",
                       "def second_largest(xs):\n    s = sorted(xs)\n"
                       "    return s[-2] if len(s) >= 2 else None\n"],
    "max_of_list": ["def max_of_list(xs):\n    return xs[len(xs) // 2]\n",
                    "def max_of_list(xs):\n    return xs[-1]\n"],
    "add": ["def add(a, b):\n    return abs(a + b)\n", "def add(a, b):\n    return a * b\n"],
    "fibonacci": ["def fibonacci(n):\n    return {0: 0, 1: 1, 5: 5, 30: 832040}[n]\n"],
    "is_prime": ["def is_prime(n):\n    return n == 2 or n % 2 == 1\n",
                 "def is_prime(n):\n    return n > 1 and all(n % i for i in range(2, n // 2))\n"],
    "anagrams": ["def are_anagrams(a, b):\n    f = lambda s: set(s.replace(' ', '').lower())\n"
                 "    return f(a) == f(b)\n"],
    "balanced": ["def balanced(s):\n    return all(s.count(a) == s.count(b) for a, b in "
                 "('()', '[]', '{}'))\n"],
    "capitalize_words": ["def capitalize_words(s):\n    return s.title()\n"],
    "caesar": ["def caesar(s, k):\n    return ''.join(chr((ord(c.lower()) - 97 + k) % 26 + 97)"
               " if c.isalpha() else c for c in s)\n"],
    "binary_search": ["def binary_search(xs, target):\n    return xs.index(target) if target "
                      "in xs[:-1] else -1\n"],
    "mode": ["def mode(xs):\n    return max(set(xs), key=xs.count)\n"],
    "gcd": ["def gcd(a, b):\n    return min(a, b) if a and b else 0\n"],
    "roman": ["def to_roman(n):\n    vals = [(1000, 'M'), (500, 'D'), (100, 'C'), (50, 'L'), "
              "(10, 'X'), (5, 'V'), (1, 'I')]\n    out = ''\n    for v, s in vals:\n"
              "        while n >= v:\n            out += s\n            n -= v\n    return out\n"],
    "chunk": ["def chunk(xs, n):\n    return [xs[i:i + n] for i in range(0, len(xs) - n + 1, n)]\n"],
}
# Red team (stop 41): each passed every hidden case before the case added for it.
for _name, _source in [
    ("fibonacci", "def fibonacci(n):\n    p = (1 + 5 ** 0.5) / 2\n    return round(p ** n / 5 ** 0.5)\n"),
    ("is_palindrome", "def is_palindrome(s):\n    t = [c.lower() for c in s if c.isalnum()]\n"
                      "    return t == t[::-1]\n"),
    ("is_prime", "def is_prime(n):\n    return n == 2 or (n > 2 and pow(2, n - 1, n) == 1)\n"),
    ("caesar", "def caesar(s, k):\n    return ''.join(chr((ord(c) - 97 + k) % 26 + 97)"
               " if c.islower() else c for c in s)\n"),
    ("anagrams", "def are_anagrams(a, b):\n    f = lambda s: sorted(c for c in s.lower() if c.isalpha())\n"
                 "    return f(a) == f(b)\n"),
    ("balanced", "def balanced(s):\n    stack = []\n    for c in s:\n        if c in '([':\n"
                 "            stack.append(c)\n        elif c in ')]':\n"
                 "            if not stack or stack.pop() != '(['[')]'.index(c)]:\n"
                 "                return False\n    return not stack\n"),
    ("capitalize_words", "import re\ndef capitalize_words(s):\n"
                         "    return re.sub(r'(^|\\s)(\\S)', lambda m: m[1] + m[2].upper(), s)\n"),
]:
  WRONG.setdefault(_name, []).append(_source)
# Red team (stop 42): each passed every hidden case before the case added for it.
for _name, _source in [
    ('add', 'def add(a, b):\n'
            '    return int(float(a) + float(b))\n'),
    ('is_even', 'def is_even(n):\n'
                '    return (n / 2).is_integer()\n'),
    ('is_even', 'def is_even(n):\n'
                '    return int(n / 2) * 2 == n\n'),
    ('reverse_string', 'def reverse_string(s):\n'
                       '    return s.strip()[::-1]\n'),
    ('factorial', 'import math\n'
                  'def factorial(n):\n'
                  '    return int(math.gamma(n + 1))\n'),
    ('is_palindrome', 'import re\n'
                      'def is_palindrome(s):\n'
                      "    t = re.sub('[^a-z]', '', s.lower())\n"
                      '    return t == t[::-1]\n'),
    ('is_palindrome', 'def is_palindrome(s):\n'
                      "    t = [c.lower() for c in s if c not in ' ,.:;!?\\'-0123456789']\n"
                      '    return t == t[::-1]\n'),
    ('sum_digits', 'def sum_digits(n):\n'
                   '    out = 0\n'
                   '    while n:\n'
                   '        out += n % 10\n'
                   '        n = int(n / 10)\n'
                   '    return out\n'),
    ('is_prime', 'def is_prime(n):\n'
                 '    return n > 1 and all(n == p or n % p for p in (2, 3, 5, 7, 11, 13))\n'),
    ('is_prime', 'def is_prime(n):\n'
                 '    return n in (2, 3, 5, 7) or (n > 1 and all(pow(a, n - 1, n) == 1 for a in (2, 3, 5, 7)))\n'),
    ('word_count', 'import re\n'
                   'def word_count(s):\n'
                   '    out = {}\n'
                   "    for w in re.findall(r'\\w+', s):\n"
                   '        out[w] = out.get(w, 0) + 1\n'
                   '    return out\n'),
    ('word_count', 'import re\n'
                   'def word_count(s):\n'
                   '    out = {}\n'
                   "    for w in re.split('[ \\n]+', s):\n"
                   '        if w:\n'
                   '            out[w] = out.get(w, 0) + 1\n'
                   '    return out\n'),
    ('capitalize_words', 'def capitalize_words(s):\n'
                         "    return ' '.join(chr(ord(w[0]) - 32) + w[1:] if w[:1].islower() and w[0].isascii() else w for w in s.split(' '))\n"),
    ('capitalize_words', 'import re\n'
                         'def capitalize_words(s):\n'
                         "    return re.sub(r'(^|[ \\n])(\\S)', lambda m: m[1] + m[2].upper(), s)\n"),
    ('roman', 'def to_roman(n):\n'
              "    out = ''\n"
              "    for v, s in [(1000, 'M'), (900, 'CM'), (400, 'CD'), (100, 'C'), (90, 'XC'), (40, 'XL'), (10, 'X'), (9, 'IX'), (4, 'IV'), (1, 'I')]:\n"
              '        while n >= v:\n'
              '            out += s\n'
              '            n -= v\n'
              '    return out\n'),
    ('celsius', 'def to_fahrenheit(c):\n'
                '    return round(c * 9 / 5 + 32, 2)\n'),
    ('balanced', 'def balanced(s):\n'
                 "    pairs = {')': '(', ']': '[', '}': '{'}\n"
                 '    stack = []\n'
                 '    for c in s:\n'
                 "        if c in '([{':\n"
                 '            stack.append(c)\n'
                 '        elif c in pairs and stack:\n'
                 '            if stack.pop() != pairs[c]:\n'
                 '                return False\n'
                 '    return not stack\n'),
    ('rle', 'import itertools\n'
            'def rle(s):\n'
            "    return ''.join(k + str(len(list(g))) for k, g in itertools.groupby(s.lower()))\n"),
    ('mode', 'def mode(xs):\n'
             '    return min(xs, key=lambda x: (-xs.count(x), abs(x)))\n'),
    ('pascal_row', 'import math\n'
                   'def pascal_row(n):\n'
                   '    return [int(math.factorial(n) / (math.factorial(k) * math.factorial(n - k))) for k in range(n + 1)]\n'),
    ('leap_year', 'def is_leap(y):\n'
                  '    return y % 4 == 0 and (y % 100 != 0 or y % 400 == 0 or y < 1582)\n'),
    ('vowel_strip', 'def strip_vowels(s):\n'
                    "    return ' '.join(''.join(c for c in w if c.lower() not in 'aeiou') for w in s.split())\n"),
    ('max_of_list', 'def max_of_list(xs):\n'
                    '    return max(int(x) for x in xs)\n'),
]:
  WRONG.setdefault(_name, []).append(_source)


# Red team (stop 43): each passed every hidden case before the case added for it.
for _name, _source in [
    ('dedupe_keep_order', 'def dedupe(xs):\n'
                          '    out = []\n'
                          '    for x in xs:\n'
                          '        if x not in out[-3:]:\n'
                          '            out.append(x)\n'
                          '    return out\n'),
    ('dedupe_keep_order', 'def dedupe(xs):\n'
                          '    return [x for i, x in enumerate(xs) if x not in xs[max(0, i - 3):i]]\n'),
    ('is_prime', 'def is_prime(n):\n'
                 '    ps = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31]\n'
                 '    return n in ps or (n > 1 and all(n % p for p in ps))\n'),
    ('is_prime', 'def is_prime(n):\n'
                 '    if n < 2:\n'
                 '        return False\n'
                 '    for i in range(2, min(n, 100)):\n'
                 '        if n % i == 0:\n'
                 '            return False\n'
                 '    return True\n'),
    ('word_count', 'import re\n'
                   'def word_count(s):\n'
                   '    out = {}\n'
                   "    for w in re.split('[ \\t\\n]+', s):\n"
                   '        if w:\n'
                   '            out[w] = out.get(w, 0) + 1\n'
                   '    return out\n'),
    ('word_count', 'def word_count(s):\n'
                   '    out = {}\n'
                   "    for w in s.replace('\\t', ' ').replace('\\n', ' ').split(' '):\n"
                   '        if w:\n'
                   '            out[w] = out.get(w, 0) + 1\n'
                   '    return out\n'),
    ('capitalize_words', 'import re\n'
                         'def capitalize_words(s):\n'
                         "    return ' '.join(re.sub(r'[^\\W\\d_]', lambda m: m[0].upper(), w, count=1) for w in s.split(' '))\n"),
]:
  WRONG.setdefault(_name, []).append(_source)


def _miller_rabin(bases: tuple) -> str:
  """An is_prime by the Miller-Rabin test with too few fixed `bases` (red team, stop 43)."""
  return ("def is_prime(n):\n    if n < 2:\n        return False\n"
          f"    for p in {bases}:\n        if n % p == 0:\n            return n == p\n"
          "    d, r = n - 1, 0\n    while d % 2 == 0:\n        d //= 2\n        r += 1\n"
          f"    for a in {bases}:\n        x = pow(a, d, n)\n        if x in (1, n - 1):\n"
          "            continue\n        for _ in range(r - 1):\n            x = x * x % n\n"
          "            if x == n - 1:\n                break\n        else:\n"
          "            return False\n    return True\n")


# Red team (stop 43, a second round): each passed every hidden case before the case added
# for it.
for _name, _source in [
    ('count_vowels', 'import re\n'
                     'def count_vowels(s):\n'
                     "    return len(re.findall('[aeiou]', s, re.IGNORECASE))\n"),
    ('count_vowels', 'import unicodedata\n'
                     'def count_vowels(s):\n'
                     "    s = unicodedata.normalize('NFKD', s)\n"
                     "    return sum(c in 'aeiou' for c in s.lower())\n"),
    ('vowel_strip', 'import re\n'
                    'def strip_vowels(s):\n'
                    "    return re.sub('[aeiou]', '', s, flags=re.I)\n"),
    ('vowel_strip', 'import unicodedata\n'
                    'def strip_vowels(s):\n'
                    "    return ''.join(c for c in s if unicodedata.normalize('NFKD', c)[0].lower() not in 'aeiou')\n"),
    ('capitalize_words', 'def capitalize_words(s):\n'
                         "    return ' '.join(w.replace(w[:1], w[:1].upper()) for w in s.split(' '))\n"),
    ('rle', 'import re\n'
            'def rle(s):\n'
            "    return re.sub(r'(.)\\1*', lambda m: m[1] + str(len(m[0])), s)\n"),
    ('rle', 'import re\n'
            'def rle(s):\n'
            "    return ''.join(m.group(0)[0] + str(len(m.group(0))) for m in re.finditer(r'(.)\\1*', s))\n"),
    ('rle', 'import re\n'
            'def rle(s):\n'
            "    return ''.join(m[1] + str(len(m[0])) for m in re.finditer(r'(\\w)\\1*', s))\n"),
    ('dedupe_keep_order', 'def dedupe(xs):\n'
                          '    out = []\n'
                          '    for x in xs:\n'
                          '        if x not in out[-4:]:\n'
                          '            out.append(x)\n'
                          '    return out\n'),
    ('gcd', 'def gcd(a, b):\n'
            '    if not a or not b:\n'
            '        return a or b\n'
            '    if a == b:\n'
            '        return a\n'
            '    for d in range(min(a, b) // 2, 0, -1):\n'
            '        if a % d == 0 and b % d == 0:\n'
            '            return d\n'),
    ('gcd', 'def gcd(a, b):\n'
            '    if not a or not b:\n'
            '        return a or b\n'
            '    if a % b == 0:\n'
            '        return b\n'
            '    for d in range(min(a, b) // 2, 0, -1):\n'
            '        if a % d == 0 and b % d == 0:\n'
            '            return d\n'),
    ('is_prime', 'def is_prime(n):\n'
                 '    if n < 2:\n'
                 '        return False\n'
                 '    for p in (2, 3, 5, 7, 11, 13):\n'
                 '        if n % p == 0:\n'
                 '            return n == p\n'
                 '    return all(pow(a, n - 1, n) == 1 for a in (2, 3, 5, 7, 11, 13))\n'),
    ('is_prime', _miller_rabin((2, 3, 5, 7))),
    ('is_prime', _miller_rabin((2, 3))),
    ('caesar', 'def caesar(s, k):\n'
               "    out = ''\n"
               '    for c in s:\n'
               "        if 'a' <= c <= 'z':\n"
               '            o = ord(c) + k\n'
               "            if o > ord('z'):\n"
               '                o -= 26\n'
               "            if o < ord('a'):\n"
               '                o += 26\n'
               '            out += chr(o)\n'
               '        else:\n'
               '            out += c\n'
               '    return out\n'),
    ('digits_to_words', 'import math\n'
                        'def digits_to_words(n):\n'
                        "    names = 'zero one two three four five six seven eight nine'.split()\n"
                        '    if n == 0:\n'
                        "        return 'zero'\n"
                        '    k = int(math.log10(n))\n'
                        "    return ' '.join(names[n // 10 ** i % 10] for i in range(k, -1, -1))\n"),
    ('chunk', 'def chunk(xs, n):\n'
              '    k = -(-len(xs) // n)\n'
              '    size = -(-len(xs) // k) if k else n\n'
              '    return [xs[i:i + size] for i in range(0, len(xs), size)]\n'),
    ('merge_sorted', 'def merge_sorted(a, b):\n'
                     '    out, i, j = [], 0, 0\n'
                     '    while i < len(a) and j < len(b):\n'
                     '        if a[i] <= b[j]:\n'
                     '            out.append(a[i]); i += 1\n'
                     '        else:\n'
                     '            out.append(b[j]); j += 1\n'
                     '    if i < len(a):\n'
                     '        out.append(a[i])\n'
                     '    return out + b[j:]\n'),
    ('anagrams', 'def are_anagrams(a, b):\n'
                 "    f = lambda s: sorted(''.join(s.split()).lower())\n"
                 '    return f(a) == f(b)\n'),
]:
  WRONG.setdefault(_name, []).append(_source)


# Red team (stop 48, helper-110): each passed every hidden case before the case added for
# it (the case-folding idioms on non-ASCII letters, whitespace other than space, tab and
# newline, and an exact formula at too little precision).
for _name, _source in [
    ('count_vowels', 'def count_vowels(s):\n'
                     "    return sum(c in 'aeiou' for c in s.lower())\n"),
    ('count_vowels', 'def count_vowels(s):\n'
                     "    return sum(c in 'aeiou' for c in s.casefold())\n"),
    ('word_count', 'import re\n'
                   'def word_count(s):\n'
                   '    out = {}\n'
                   "    for w in re.findall(r'\\S+', s, re.ASCII):\n"
                   '        out[w] = out.get(w, 0) + 1\n'
                   '    return out\n'),
    ('word_count', 'import re\n'
                   'def word_count(s):\n'
                   '    out = {}\n'
                   "    for w in re.split('[ \\t\\r\\n]+', s):\n"
                   '        if w:\n'
                   '            out[w] = out.get(w, 0) + 1\n'
                   '    return out\n'),
    ('anagrams', 'def are_anagrams(a, b):\n'
                 "    f = lambda s: sorted(s.replace(' ', '').upper())\n"
                 '    return f(a) == f(b)\n'),
    ('fibonacci', 'from decimal import Decimal\n'
                  'def fibonacci(n):\n'
                  '    phi = (1 + Decimal(5).sqrt()) / 2\n'
                  '    return int((phi ** n / Decimal(5).sqrt()).to_integral_value())\n'),
]:
  WRONG.setdefault(_name, []).append(_source)

# Red team (stop 48, helper-111, a second round): each passed every hidden case before
# the case added for it (a whole string lower-cased makes a final sigma, 'İ' two
# characters; negative numbers; Miller-Rabin with the usual fixed bases; substring
# counts; an unmatched closer skipped; a sentinel eating a last run of spaces; Roman
# digits 5 and 49; leap-year rules past the Gregorian; precision of 110 digits).
for _name, _source in [
    ('is_palindrome', 'def is_palindrome(s):\n'
                     "    t = ''.join(c for c in s if c.isalpha()).lower()\n"
                     '    return t == t[::-1]\n'),
    ('is_palindrome', 'def is_palindrome(s):\n'
                     '    t = [c for c in s.lower() if c.isalpha()]\n'
                     '    return t == t[::-1]\n'),
    ('is_palindrome', 'import re\n'
                     'def is_palindrome(s):\n'
                     "    t = re.sub(r'[\\W\\d_]', '', s).lower()\n"
                     '    return t == t[::-1]\n'),
    ('is_palindrome', 'def is_palindrome(s):\n'
                     "    t = ''.join(c.lower() for c in s if c.isalpha())\n"
                     '    return t == t[::-1]\n'),
    ('is_palindrome', 'import string\n'
                     'def is_palindrome(s):\n'
                     '    t = [c.lower() for c in s if c not in string.punctuation + string.whitespace + string.digits]\n'
                     '    return t == t[::-1]\n'),
    # (the reference's trial division under a guard that lets negative numbers through)
    ('is_prime', BY_NAME['is_prime'][2].replace('if n < 2:', 'if n in (0, 1):')),
    ('is_prime', BY_NAME['is_prime'][2].replace('    if n < 2:', '    n = abs(n)\n    if n < 2:')),
    ('is_prime', _miller_rabin((2, 7, 61))),
    ('is_prime', _miller_rabin((2, 3, 5, 7, 11))),
    ('is_prime', _miller_rabin((2, 3, 5, 7, 11, 13, 17, 19, 23))),
    ('word_count', 'def word_count(s):\n'
                  '    return {w: s.count(w) for w in s.split()}\n'),
    # (the reference, skipping a closer that does not match instead of failing)
    ('balanced', BY_NAME['balanced'][2].replace(
        'if not stack or stack.pop() != pairs[c]:\n                return False\n',
        'if not stack:\n                return False\n'
        '            if stack[-1] == pairs[c]:\n                stack.pop()\n')),
    ('rle', 'def rle(s):\n'
           "    out, cnt, prev = '', 0, ''\n"
           "    for c in s + ' ':\n"
           '        if c == prev:\n'
           '            cnt += 1\n'
           '        else:\n'
           '            if cnt: out += prev + str(cnt)\n'
           '            prev, cnt = c, 1\n'
           '    return out\n'),
    ('roman', 'def to_roman(n):\n'
             '    digits = []\n'
             "    for one, five, ten in (('I', 'V', 'X'), ('X', 'L', 'C'), ('C', 'D', 'M'), ('M', '', '')):\n"
             '        d = n % 10; n //= 10\n'
             '        if d == 9: s = one + ten\n'
             '        elif d > 5: s = five + one * (d - 5)\n'
             '        elif d == 4: s = one + five\n'
             '        else: s = one * d\n'
             '        digits.append(s)\n'
             "    return ''.join(reversed(digits))\n"),
    ('roman', 'def to_roman(n):\n'
             "    out = ''\n"
             "    for v, s in [(1000, 'M'), (900, 'CM'), (500, 'D'), (400, 'CD'), (100, 'C'), (90, 'XC'), (50, 'L'), (49, 'IL'), (40, 'XL'), (10, 'X'), (9, 'IX'), (5, 'V'), (4, 'IV'), (1, 'I')]:\n"
             '        while n >= v:\n'
             '            out += s\n'
             '            n -= v\n'
             '    return out\n'),
    ('leap_year', 'import datetime\n'
                 'def is_leap(y):\n'
                 '    try:\n'
                 '        datetime.date(y, 2, 29)\n'
                 '        return True\n'
                 '    except ValueError:\n'
                 '        return False\n'),
    ('leap_year', 'def is_leap(y):\n'
                 '    return y % 4 == 0 and (y % 100 != 0 or y % 400 == 0) and y % 4000 != 0\n'),
    ('leap_year', 'def is_leap(y):\n'
                 '    return y % 4 == 0 and (y % 100 != 0 or (y // 100) % 2 == 0)\n'),
    ('anagrams', 'def are_anagrams(a, b):\n'
                "    f = lambda s: sorted(s.strip().replace(' ', '').lower())\n"
                '    return f(a) == f(b)\n'),
    ('fibonacci', 'from decimal import Decimal, localcontext\n'
                 'def fibonacci(n):\n'
                 '    with localcontext() as ctx:\n'
                 '        ctx.prec = 110\n'
                 '        phi = (1 + Decimal(5).sqrt()) / 2\n'
                 '        return int((phi ** n / Decimal(5).sqrt()).to_integral_value())\n'),
    ('dedupe_keep_order', 'def dedupe(xs):\n'
                         '    out = []\n'
                         '    for x in xs:\n'
                         '        if x not in out[-8:]:\n'
                         '            out.append(x)\n'
                         '    return out\n'),
    ('celsius', 'def to_fahrenheit(c):\n'
               '    return round(c * 9 / 5 + 32, 3)\n'),
]:
  WRONG.setdefault(_name, []).append(_source)


def _sieve_to(limit: str) -> str:
  """is_prime by a sieve precomputed to `limit`, False past it."""
  return ('def _sieve(n):\n'
          '    is_p = [True] * (n + 1)\n'
          '    is_p[0] = is_p[1] = False\n'
          '    for i in range(2, int(n ** 0.5) + 1):\n'
          '        if is_p[i]:\n'
          '            for j in range(i * i, n + 1, i):\n'
          '                is_p[j] = False\n'
          '    return is_p\n'
          f'_P = _sieve({limit})\n'
          'def is_prime(n):\n'
          f'    return 0 <= n <= {limit} and _P[n]\n')

# Red team (stop 49, helper-112, a third round): each passed every hidden case before
# the case added for it (primes past a precomputed sieve or a capped trial division; a
# sentinel start or 'not best'; a negative shift past one wrap; an end marker the text
# may hold; '_', Hebrew letters and symbols in palindromes; rounding an exact
# conversion; title case for upper case; a dropped newline; a 3200-year rule; counting
# through range() on floats; Binet at 200 digits; fixed rounds of bracket deletion; a
# look-back of 9).
for _name, _source in [
    ('is_prime', _sieve_to('10000')),
    ('is_prime', _sieve_to('10**6')),
    ('is_prime', 'def is_prime(n):\n'
                 '    if n < 2: return False\n'
                 '    i = 2\n'
                 '    while i * i <= n and i < 10**6:\n'
                 '        if n % i == 0: return False\n'
                 '        i += 1\n'
                 '    return True\n'),
    ('max_of_list', 'def max_of_list(xs):\n'
                    '    best = None\n'
                    '    for x in xs:\n'
                    '        if not best or x > best:\n'
                    '            best = x\n'
                    '    return best\n'),
    ('max_of_list', 'def max_of_list(xs):\n'
                    '    best = -10**9\n'
                    '    for x in xs:\n'
                    '        if x > best:\n'
                    '            best = x\n'
                    '    return best\n'),
    ('second_largest', 'def second_largest(xs):\n'
                       '    first = second = -10**9\n'
                       '    for x in xs:\n'
                       '        if x > first:\n'
                       '            first, second = x, first\n'
                       '        elif first > x > second:\n'
                       '            second = x\n'
                       '    return None if second == -10**9 else second\n'),
    ('caesar', 'import string\n'
               'def caesar(s, k):\n'
               '    a = string.ascii_lowercase\n'
               '    k = k % 26 if k > 0 else k\n'
               '    return s.translate(str.maketrans(a, a[k:] + a[:k]))\n'),
    ('caesar', 'def caesar(s, k):\n'
               "    out = ''\n"
               '    for c in s:\n'
               "        if 'a' <= c <= 'z':\n"
               '            o = ord(c) + k\n'
               "            while o > ord('z'): o -= 26\n"
               "            if o < ord('a'): o += 26\n"
               '            out += chr(o)\n'
               '        else:\n'
               '            out += c\n'
               '    return out\n'),
    # (the second round's sentinel, one the text may hold)
    ('rle', next(s for s in WRONG['rle'] if "s + ' '" in s).replace("s + ' '", "s + '#'")),
    ('is_palindrome', 'import re\n'
                      'def is_palindrome(s):\n'
                      "    t = re.sub(r'[\\W\\d]', '', s).upper()\n"
                      '    return t == t[::-1]\n'),
    ('is_palindrome', 'def is_palindrome(s):\n'
                      '    t = [c.lower() for c in s if c.lower() != c.upper()]\n'
                      '    return t == t[::-1]\n'),
    ('is_palindrome', 'import unicodedata\n'
                      'def is_palindrome(s):\n'
                      "    t = [c.lower() for c in s if unicodedata.category(c)[0] not in 'PZNC']\n"
                      '    return t == t[::-1]\n'),
    ('celsius', 'def to_fahrenheit(c):\n'
                '    return round(c * 9 / 5 + 32, 4)\n'),
    ('celsius', 'def to_fahrenheit(c):\n'
                "    return float(f'{c * 9 / 5 + 32:.6g}')\n"),
    ('capitalize_words', 'def capitalize_words(s):\n'
                         "    return ' '.join(w[:1].capitalize() + w[1:] for w in s.split(' '))\n"),
    ('reverse_string', 'def reverse_string(s):\n'
                       "    return s.rstrip('\\n')[::-1]\n"),
    ('leap_year', 'def is_leap(y):\n'
                  '    return y % 4 == 0 and (y % 100 != 0 or y % 400 == 0) and y % 3200 != 0\n'),
    ('unique_sorted', 'def unique_sorted(xs):\n'
                      '    if not xs: return []\n'
                      '    s = set(xs)\n'
                      '    return [v for v in range(min(xs), max(xs) + 1) if v in s]\n'),
    ('fibonacci', 'from decimal import Decimal, getcontext\n'
                  'getcontext().prec = 200\n'
                  'def fibonacci(n):\n'
                  '    phi = (1 + Decimal(5).sqrt()) / 2\n'
                  '    return int((phi ** n / Decimal(5).sqrt()).to_integral_value())\n'),
    ('balanced', 'def balanced(s):\n'
                 "    t = ''.join(c for c in s if c in '()[]{}')\n"
                 '    for _ in range(2):\n'
                 "        t = t.replace('()', '').replace('[]', '').replace('{}', '')\n"
                 '    return not t\n'),
    ('dedupe_keep_order', 'def dedupe(xs):\n'
                          '    out = []\n'
                          '    for x in xs:\n'
                          '        if x not in out[-9:]:\n'
                          '            out.append(x)\n'
                          '    return out\n'),
]:
  WRONG.setdefault(_name, []).append(_source)

# Right solutions other than the reference's way, which the cases added above must not
# fail (case-folding the anagrams, a memoised recursion, a split on every white space).
RIGHT = {
    'anagrams': ['def are_anagrams(a, b):\n'
                 "    f = lambda s: sorted(s.replace(' ', '').casefold())\n"
                 '    return f(a) == f(b)\n'],
    'fibonacci': ['import functools\n'
                  '@functools.lru_cache(None)\n'
                  'def fibonacci(n):\n'
                  '    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n'],
    'word_count': ['import collections\n'
                   'def word_count(s):\n'
                   '    return dict(collections.Counter(s.split()))\n'],
    'count_vowels': ['def count_vowels(s):\n'
                     "    return sum(1 for c in s if c in 'aeiouAEIOU')\n"],
    'is_palindrome': ['def is_palindrome(s):\n'
                      "    t = [c.casefold() for c in s if c.isalpha()]\n"
                      '    return t == t[::-1]\n'],
    'is_prime': ['import math\n'
                 'def is_prime(n):\n'
                 '    return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))\n'],
    'leap_year': ['import calendar\n'
                  'def is_leap(y):\n'
                  '    return calendar.isleap(y)\n',
                  'def is_leap(y):\n'
                  '    return y % 400 == 0 or (y % 4 == 0 and y % 100 != 0)\n'],
    # (the third round's cases: end markers, negative shifts, exact floats, any values;
    # some of these are written as the reference is, kept passing all the same)
    'rle': ['import itertools\n'
            'def rle(s):\n'
            "    return ''.join(k + str(len(list(g))) for k, g in itertools.groupby(s))\n"],
    'caesar': ['def caesar(s, k):\n'
               "    return ''.join(chr((ord(c) - 97 + k) % 26 + 97) if 'a' <= c <= 'z' else c\n"
               '                   for c in s)\n'],
    'celsius': ['def to_fahrenheit(c):\n'
                '    return c * 1.8 + 32\n'],
    'second_largest': ['def second_largest(xs):\n'
                       '    s = sorted(set(xs))\n'
                       '    return s[-2] if len(s) > 1 else None\n'],
    'unique_sorted': ['def unique_sorted(xs):\n'
                      '    return sorted(set(xs))\n'],
    'dedupe_keep_order': ['def dedupe(xs):\n'
                          '    return list(dict.fromkeys(xs))\n'],
    'balanced': ['def balanced(s):\n'
                 "    s = ''.join(c for c in s if c in '()[]{}')\n"
                 "    while '()' in s or '[]' in s or '{}' in s:\n"
                 "        s = s.replace('()', '').replace('[]', '').replace('{}', '')\n"
                 '    return not s\n'],
}


def function(source: str):
  ns = {}
  exec(source, ns)
  return ns[_function_name(source)]


def passes(fn, cases) -> bool:
  for args, expected in cases:
    try:
      got = fn(*copy.deepcopy(args))
    except Exception:
      return False
    if not strict_equal(got, expected):
      return False
  return True


@pytest.mark.parametrize("task", TASKS, ids=[t[0] for t in TASKS])
def test_hidden_cases_are_the_references_and_hold_the_public_example(task):
  name, _, reference, public, cases = task
  assert len(cases) >= 5, name
  assert passes(function(reference), cases)
  # A "solution" that knows only the hidden cases passes the public test: the example
  # the prompt shows is graded too (a solution failing it passed three tasks).
  table = {repr(args): expected for args, expected in cases}
  fn = _function_name(reference)
  exec(public, {fn: lambda *args: table[repr(args)]})


@pytest.mark.parametrize("name", sorted(WRONG))
def test_wrong_solutions_fail_the_hidden_cases(name):
  cases = BY_NAME[name][4]
  for source in WRONG[name]:
    assert not passes(function(source), cases), source


@pytest.mark.parametrize("name", sorted(RIGHT))
def test_other_right_solutions_pass_the_hidden_cases(name):
  for source in RIGHT[name]:
    assert passes(function(source), BY_NAME[name][4]), source
