"""A corpus of ordinary Pydantic v2 models: every kind of schema `model_json_schema()` emits for
them (issue 46): tuples (prefixItems), Literal and enums, discriminated and plain unions (oneOf /
anyOf + const, `discriminator`), constrained strings (pattern, lengths, formats), Optional,
dict[str, X], nested and recursive models ($defs/$ref), numeric bounds and multipleOf. Shared by
tests/test_pydantic_corpus.py."""

from __future__ import annotations

import datetime
import enum
import uuid
from decimal import Decimal
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class Colour(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Level(enum.IntEnum):
    low = 1
    mid = 2
    high = 3


class Address(BaseModel):
    street: str = Field(max_length=24)
    city: str = Field(max_length=16)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Scalars(BaseModel):
    name: str = Field(max_length=20)
    age: int
    ok: bool
    score: float


class Optionals(BaseModel):
    nickname: Optional[str] = Field(default=None, max_length=12)
    count: int | None = None
    flag: bool = False


class Literals(BaseModel):
    mode: Literal["fast", "slow"]
    size: Literal[1, 2, 3]


class Enums(BaseModel):
    colour: Colour
    level: Level


class Pair(BaseModel):
    pair: tuple[int, str] = Field(...)


class Point3(BaseModel):
    xyz: tuple[float, float, float]


class VarTuple(BaseModel):
    values: tuple[int, ...] = Field(max_length=4)


class BoundedList(BaseModel):
    tags: list[Annotated[str, Field(max_length=8)]] = Field(min_length=1, max_length=3)


class IntMap(BaseModel):
    counts: dict[str, int] = Field(max_length=3)


class ModelMap(BaseModel):
    places: dict[str, Address] = Field(max_length=2)


class Person(BaseModel):
    name: str = Field(max_length=16)
    home: Address


class Company(BaseModel):
    name: str = Field(max_length=16)
    ceo: Person
    founded: int = Field(ge=1800, le=2030)


class Team(BaseModel):
    members: list[Person] = Field(max_length=2)


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=1, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Pet(BaseModel):
    pet: Union[Cat, Dog] = Field(discriminator="kind")


class IntOrStr(BaseModel):
    value: Union[int, str] = Field(union_mode="left_to_right")


class Shape(BaseModel):
    shape: Union[Point3, Pair]


class Code(BaseModel):
    code: str = Field(pattern=r"^[A-Z]{3}-[0-9]{3}$")


class Lengths(BaseModel):
    short: str = Field(min_length=2, max_length=5)
    word: str = Field(min_length=1, max_length=10, pattern=r"^[a-z]+$")


class Moments(BaseModel):
    when: datetime.datetime
    day: datetime.date
    at: datetime.time


class Ident(BaseModel):
    id: uuid.UUID


class IntBounds(BaseModel):
    percent: int = Field(ge=0, le=100)
    negative: int = Field(lt=0, gt=-1000)


class FloatBounds(BaseModel):
    ratio: float = Field(gt=0.0, lt=1.0)
    temp: float = Field(ge=-40.0, le=60.0)


class Multiples(BaseModel):
    even: int = Field(multiple_of=2, ge=0, le=100)
    fives: int = Field(multiple_of=5)


class Node(BaseModel):
    name: str = Field(max_length=8)
    children: list[Node] = Field(max_length=2)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
    a: int
    b: str = Field(max_length=10)


class Aliased(BaseModel):
    first_name: str = Field(alias="firstName", max_length=12)
    last_name: str = Field(alias="lastName", max_length=12)


class Digits(BaseModel):
    digits: list[Annotated[int, Field(ge=0, le=9)]] = Field(max_length=5)


class Choices(BaseModel):
    picks: list[Literal["x", "y", "z"]] = Field(max_length=4)


class MaybeAddress(BaseModel):
    name: str = Field(max_length=12)
    address: Optional[Address] = None


class Money(BaseModel):
    amount: Decimal = Field(max_digits=6, decimal_places=2)
    currency: Literal["EUR", "USD"]


class Order(BaseModel):
    id: int = Field(ge=1)
    items: list[tuple[str, int]] = Field(max_length=3)
    status: Literal["new", "paid", "shipped"]
    note: Optional[str] = Field(default=None, max_length=20)


class Event(BaseModel):
    title: str = Field(max_length=20)
    day: datetime.date
    level: Level
    where: Optional[Address] = None


CORPUS: list[type[BaseModel]] = [
    Scalars, Optionals, Literals, Enums, Pair, Point3, VarTuple, BoundedList, IntMap, ModelMap, Person, Company,
    Team, Pet, IntOrStr, Shape, Code, Lengths, Moments, Ident, IntBounds, FloatBounds, Multiples, Node, Strict,
    Aliased, Digits, Choices, MaybeAddress, Money, Order, Event, Address, Cat,
]


class Unique(BaseModel):
    tags: set[str]  # uniqueItems: llguidance cannot enforce it


# Models whose schema cannot be enforced: (model, the keyword the refusal names).
REFUSED: list[tuple[type[BaseModel], str]] = [(Unique, "uniqueItems")]
