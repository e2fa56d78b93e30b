"""A test set of 50 JSON schemas for structured output, written for this project after the kinds public JSON-schema
benchmarks for LLMs cover: flat and nested objects, enums and consts, arrays with bounds, anyOf / oneOf, string
formats and patterns, integers with ranges, optional fields, `$ref` nesting. Every string, array and depth is bounded
so that a complete answer fits the tests' max_tokens: SmolLM2-135M repeats a truly recursive pattern, or the digits
of an unbounded number, until max_tokens cuts it (a grammar bounds what may come, not how long the model goes on),
so recursion here is `$ref`s to a fixed depth. Each entry pairs what to ask for with its schema."""

from __future__ import annotations

from typing import Any

S = {"type": "string", "maxLength": 16}
INT = {"type": "integer", "minimum": 0, "maximum": 1000}


def obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


def arr(items: dict[str, Any], lo: int = 1, hi: int = 3) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", obj({"name": S, "age": INT})),
    ("a city", obj({"city": S, "country": S, "population": INT})),
    ("a book", obj({"title": {"type": "string", "maxLength": 24}, "author": S, "year": INT})),
    ("a colour", obj({"colour": {"enum": ["red", "green", "blue", "yellow"]}})),
    ("a yes or no answer", obj({"answer": {"type": "boolean"}})),
    ("a temperature", obj({"celsius": {"type": "integer", "minimum": -90, "maximum": 60}})),
    ("a product", obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "price": INT})),
    ("a date", obj({"date": {"type": "string", "format": "date"}})),
    ("an email contact", obj({"email": {"type": "string", "format": "email", "maxLength": 24}})),
    ("a list of fruits", obj({"fruits": arr(S)})),
    ("three numbers", obj({"numbers": arr({"type": "integer", "minimum": 0, "maximum": 99}, 3, 3)})),
    ("a point", obj({"x": {"type": "integer", "minimum": -999, "maximum": 999},
                     "y": {"type": "integer", "minimum": -999, "maximum": 999}})),
    ("a rectangle", obj({"top_left": obj({"x": INT, "y": INT}), "size": obj({"w": INT, "h": INT})})),
    ("an address", obj({"street": S, "number": INT, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    ("a user with an optional nickname", obj({"name": S, "nickname": S}, ["name"])),
    ("a status", obj({"status": {"const": "ok"}, "code": {"enum": [200, 201, 204]}})),
    ("a shape", {"anyOf": [obj({"kind": {"const": "circle"}, "r": INT}),
                           obj({"kind": {"const": "square"}, "side": INT})]}),
    ("a pet", {"oneOf": [obj({"species": {"const": "cat"}, "lives": {"type": "integer", "minimum": 1,
                                                                      "maximum": 9}}),
                         obj({"species": {"const": "dog"}, "breed": S})]}),
    ("a team", obj({"team": S, "members": arr(obj({"name": S, "role": {"enum": ["lead", "dev", "ops"]}}))})),
    ("an order", obj({"id": INT, "lines": arr(obj({"item": S, "qty": {"type": "integer", "minimum": 1,
                                                                       "maximum": 9}}))})),
    ("a weather report", obj({"city": S, "sky": {"enum": ["sunny", "cloudy", "rainy"]},
                              "wind_kmh": {"type": "integer", "minimum": 0, "maximum": 200}})),
    ("a score", obj({"home": {"type": "integer", "minimum": 0, "maximum": 20},
                     "away": {"type": "integer", "minimum": 0, "maximum": 20}})),
    ("a flag set", obj({"flags": arr({"enum": ["a", "b", "c", "d"]}, 0, 4)})),
    ("a nested config", obj({"server": obj({"host": S, "port": {"type": "integer", "minimum": 1,
                                                                "maximum": 65535}}),
                             "debug": {"type": "boolean"}})),
    ("a tag list", obj({"tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4,
                                 "uniqueItems": True}})),
    ("a percentage", obj({"value": {"type": "integer", "minimum": 0, "maximum": 100}})),
    ("a null or a name", obj({"name": {"anyOf": [S, {"type": "null"}]}})),
    ("a time of day", obj({"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                           "minute": {"type": "integer", "minimum": 0, "maximum": 59}})),
    ("a movie", obj({"title": {"type": "string", "maxLength": 24}, "genre": {"enum": ["drama", "comedy",
                                                                                       "action"]},
                     "rating": {"type": "integer", "minimum": 0, "maximum": 10}})),
    ("a recipe", obj({"dish": {"type": "string", "maxLength": 12},
                      "ingredients": arr({"type": "string", "maxLength": 12}, 1, 3), "minutes": INT})),
    ("a phone number", obj({"phone": {"type": "string", "pattern": "^\\+[0-9]{2} [0-9]{3} [0-9]{4}$"}})),
    ("a version", obj({"major": INT, "minor": INT, "patch": INT})),
    ("a key-value pair", obj({"key": {"type": "string", "pattern": "^[a-z_]{1,12}$"}, "value": S})),
    ("a matrix", obj({"rows": arr(arr({"type": "integer", "minimum": 0, "maximum": 9}, 2, 2), 2, 2)})),
    ("an event", obj({"name": S, "day": {"type": "string", "format": "date"},
                      "online": {"type": "boolean"}})),
    ("a vote", obj({"choice": {"enum": ["for", "against", "abstain"]}})),
    ("a car", obj({"make": S, "model": S, "doors": {"enum": [2, 3, 4, 5]}})),
    ("a language", obj({"language": {"enum": ["English", "French", "German", "Spanish"]},
                        "speakers_millions": INT})),
    ("a planet", obj({"planet": S, "moons": {"type": "integer", "minimum": 0, "maximum": 100},
                      "has_rings": {"type": "boolean"}})),
    ("a bank transfer", obj({"from": S, "to": S, "amount": {"type": "integer", "minimum": 1, "maximum": 10000}})),
    ("a tree", {"$defs": {
        "leaf": obj({"label": {"type": "string", "maxLength": 8}}),
        "node": obj({"label": {"type": "string", "maxLength": 8},
                     "children": {"type": "array", "items": {"$ref": "#/$defs/leaf"}, "maxItems": 2}})},
        **obj({"label": {"type": "string", "maxLength": 8},
               "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}})}),
    ("a linked list", {"$defs": {
        "last": obj({"value": {"type": "integer", "minimum": 0, "maximum": 9}, "next": {"type": "null"}}),
        "cell": obj({"value": {"type": "integer", "minimum": 0, "maximum": 9},
                     "next": {"anyOf": [{"$ref": "#/$defs/last"}, {"type": "null"}]}})},
        **obj({"value": {"type": "integer", "minimum": 0, "maximum": 9},
               "next": {"anyOf": [{"$ref": "#/$defs/cell"}, {"type": "null"}]}})}),
    ("a grade", obj({"student": S, "grade": {"type": "string", "pattern": "^[A-F][+-]?$"}})),
    ("a to-do list", obj({"todos": arr(obj({"task": {"type": "string", "maxLength": 20},
                                            "done": {"type": "boolean"}}), 1, 3)})),
    ("a coordinate pair", obj({"lat": {"type": "integer", "minimum": -90, "maximum": 90},
                               "lon": {"type": "integer", "minimum": -180, "maximum": 180}})),
    ("a server log line", obj({"level": {"enum": ["INFO", "WARN", "ERROR"]},
                               "message": {"type": "string", "maxLength": 24}})),
    ("a currency amount", obj({"currency": {"enum": ["EUR", "USD", "GBP"]}, "cents": INT})),
    ("a sports result", obj({"winner": S, "loser": S, "sets": arr({"type": "string",
                                                                   "pattern": "^[0-7]-[0-7]$"}, 2, 3)})),
    ("a contact card", obj({"name": S, "emails": arr({"type": "string", "format": "email", "maxLength": 24}, 1, 2),
                            "company": S}, ["name", "emails"])),
    ("a few labels as an object", {"type": "object", "maxProperties": 3,
                                   "patternProperties": {"^[a-z]{1,10}$": {"type": "string", "maxLength": 12}},
                                   "additionalProperties": False}),
]

assert len(SCHEMAS) == 50
