"""What language a header cell of a corpus names: an ISO 639 code or a BCP 47 tag (read by `langcodes`: ``en``,
``eng``, ``ger``, ``pt-BR``, ``zh-Hant``), or the English name or own name of a language in common MT use
(``English``, ``Spanish``, ``Español``). Only a cell that is exactly one of these names a language; case is ignored.

`langcodes` knows every ISO 639-3 code, and many of them are also short words (``yes``, ``one``, ``the``), so a
three-letter code counts fully only for a language that also has a two-letter code (``eng``, ``spa``); another one
(``ceb``, ``yue``) counts only beside a language of the run (see :func:`header_languages`). Names come from the table
below: `langcodes` reads names only with the 13 MB `language_data` package.
"""

import langcodes

# ISO 639-1 code: English name(s), then own name(s). The languages of WMT, OPUS-100 and FLORES' larger sets.
_NAMES = {
    "af": ("Afrikaans",), "am": ("Amharic", "አማርኛ"), "ar": ("Arabic", "العربية"), "az": ("Azerbaijani", "Azərbaycan"),
    "be": ("Belarusian", "Беларуская"), "bg": ("Bulgarian", "Български"), "bn": ("Bengali", "Bangla", "বাংলা"),
    "bs": ("Bosnian", "Bosanski"), "ca": ("Catalan", "Català"), "cs": ("Czech", "Čeština"),
    "cy": ("Welsh", "Cymraeg"), "da": ("Danish", "Dansk"), "de": ("German", "Deutsch"), "el": ("Greek", "Ελληνικά"),
    "en": ("English",), "eo": ("Esperanto",), "es": ("Spanish", "Castilian", "Español", "Castellano"),
    "et": ("Estonian", "Eesti"), "eu": ("Basque", "Euskara"), "fa": ("Persian", "Farsi", "فارسی"),
    "fi": ("Finnish", "Suomi"), "fr": ("French", "Français"), "ga": ("Irish", "Gaeilge"),
    "gl": ("Galician", "Galego"), "gu": ("Gujarati", "ગુજરાતી"), "ha": ("Hausa",), "he": ("Hebrew", "עברית"),
    "hi": ("Hindi", "हिन्दी"), "hr": ("Croatian", "Hrvatski"), "hu": ("Hungarian", "Magyar"),
    "hy": ("Armenian", "Հայերեն"), "id": ("Indonesian", "Bahasa Indonesia"), "is": ("Icelandic", "Íslenska"),
    "it": ("Italian", "Italiano"), "ja": ("Japanese", "日本語"), "ka": ("Georgian", "ქართული"),
    "kk": ("Kazakh", "Қазақша"), "km": ("Khmer", "ខ្មែរ"), "kn": ("Kannada", "ಕನ್ನಡ"), "ko": ("Korean", "한국어"),
    "ky": ("Kyrgyz", "Кыргызча"), "la": ("Latin", "Latina"), "lt": ("Lithuanian", "Lietuvių"),
    "lv": ("Latvian", "Latviešu"), "mk": ("Macedonian", "Македонски"), "ml": ("Malayalam", "മലയാളം"),
    "mn": ("Mongolian", "Монгол"), "mr": ("Marathi", "मराठी"), "ms": ("Malay", "Bahasa Melayu"),
    "mt": ("Maltese", "Malti"), "my": ("Burmese", "မြန်မာ"), "nb": ("Norwegian Bokmål", "Bokmål"),
    "ne": ("Nepali", "नेपाली"), "nl": ("Dutch", "Flemish", "Nederlands"), "nn": ("Norwegian Nynorsk", "Nynorsk"),
    "no": ("Norwegian", "Norsk"), "pa": ("Punjabi", "ਪੰਜਾਬੀ"), "pl": ("Polish", "Polski"), "ps": ("Pashto", "پښتو"),
    "pt": ("Portuguese", "Português"), "ro": ("Romanian", "Română"), "ru": ("Russian", "Русский"),
    "si": ("Sinhala", "සිංහල"), "sk": ("Slovak", "Slovenčina"), "sl": ("Slovenian", "Slovenščina"),
    "so": ("Somali", "Soomaali"), "sq": ("Albanian", "Shqip"), "sr": ("Serbian", "Српски", "Srpski"),
    "sv": ("Swedish", "Svenska"), "sw": ("Swahili", "Kiswahili"), "ta": ("Tamil", "தமிழ்"),
    "te": ("Telugu", "తెలుగు"), "th": ("Thai", "ไทย"), "tl": ("Tagalog", "Filipino"), "tr": ("Turkish", "Türkçe"),
    "uk": ("Ukrainian", "Українська"), "ur": ("Urdu", "اردو"), "uz": ("Uzbek", "Oʻzbek"),
    "vi": ("Vietnamese", "Tiếng Việt"), "xh": ("Xhosa", "isiXhosa"), "yo": ("Yoruba", "Yorùbá"),
    "zh": ("Chinese", "Mandarin", "中文", "汉语", "漢語"), "zu": ("Zulu", "isiZulu"),
}
LANGUAGE_NAMES = {name.casefold(): code for code, names in _NAMES.items() for name in names}


def named_language(cell: str) -> tuple[str, bool] | None:
    """(the language's code, whether the cell names it surely) for a cell that is exactly a language's name, ISO 639
    code or BCP 47 tag (``"eng"`` -> ``("en", True)``, ``"ceb"`` -> ``("ceb", False)``); None for any other text."""
    text = cell.strip()
    if text.casefold() in LANGUAGE_NAMES:
        return _code(LANGUAGE_NAMES[text.casefold()]), True
    if not (text.isascii() and 2 <= len(text) <= 20 and text.replace("-", "").replace("_", "").isalnum()):
        return None
    try:
        tag = langcodes.Language.get(text, normalize=True)
    except (langcodes.LanguageTagError, ValueError):
        return None
    if not tag.is_valid() or not tag.language or tag.language in ("und", "mul", "zxx", "mis"):
        return None
    primary = text.replace("_", "-").split("-")[0]
    return tag.language, len(primary) == 2 or len(tag.language) == 2


def _code(code: str) -> str:
    """The code `langcodes` normalises ``code`` to (``tl`` -> ``fil``), so that names and codes compare."""
    return langcodes.Language.get(code, normalize=True).language


def same_language(code: str, cell_language: str) -> bool:
    """Whether ``--source_lang``/``--target_lang`` ``code`` is the language a header cell names (by code)."""
    found = named_language(code)
    return (found[0] if found else code.casefold()) == cell_language


def header_languages(cells: list[str], languages: tuple[str, str]) -> tuple[str, ...] | None:
    """The languages a first row of two cells names when it reads as a header, None when it reads as a pair.

    Each cell must name a language (a cell that is ``--source_lang``/``--target_lang`` itself or names the same
    language is given as that code), the two languages must differ (``No<TAB>No`` is a pair), and a three-letter code
    of a language without a two-letter one (``ceb``, but also ``yes``, ``the``) counts only beside a language of the
    run (``en<TAB>ceb``). ``Yes<TAB>Sí`` and ``the<TAB>el`` are pairs."""
    named = []
    for cell in cells:
        found = named_language(cell)
        ours = next((lang for lang in languages if cell.strip().casefold() == lang.casefold()
                     or (found is not None and same_language(lang, found[0]))), None)
        if ours is None and found is None:
            return None
        named.append((ours, True) if ours is not None else found)
    codes = tuple(code for code, _ in named)
    if len(named) < 2 or len(set(codes)) < len(codes):
        return None
    if not all(sure for _, sure in named) and not set(codes) & set(languages):
        return None
    return codes
