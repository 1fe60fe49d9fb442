"""Texts the tokenizer tests encode: mixed scripts, whitespace, HTML, emoji, non-NFC forms, the empty string."""

TEXTS = [
    "Hello, world!",
    "I'm sure they'LL say it's DON'T-or-won't",
    "Numbers 1234567890 and 3.14159, 1,000,000 and ½ ⅞",
    "tabs\tand  double  spaces   then\n\n\nnewlines\r\n and trailing   ",
    "<div class=\"product-desc\"><style>.a{color:#333;margin:0 auto}</style><script>var x=1;</script></div>",
    "北欧风格的陶瓷马克杯，容量350毫升。日本語のテキストも。한국어 텍스트",
    "emoji 🤖🎁👩‍👩‍👧‍👦 flags 🇯🇵 and ✨ sparkle",
    "NFC: e\u0301 vs \u00e9, Å vs A\u030a, ﬁ ligature",
    "Arabic مرحبا بالعالم and Hindi नमस्ते दुनिया and Thai สวัสดี",
    "    def f(x):\n        return {'k': [1, 2, 3]}  # comment\n",
    "Clothing & Accessories > Clothing > Shirts > Polo Shirts",
    '{"category": "A > B", "brand": "giorgio armani", "is_secondhand": false}',
    "Machine washable at 30°C — free returns; 24 × 18 × 6 cm",
    " ",
    "",
]
