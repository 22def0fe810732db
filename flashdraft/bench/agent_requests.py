"""What `--dataset structured` asks (bench/datasets.py): the schemas of its JSON records, the tools its
tool calls choose from, and the subjects and tasks of its prompts."""

from __future__ import annotations

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24}, "skills": {"type": "array", "items": {"type": "string",
                                                                                     "maxLength": 20},
                                                          "maxItems": 4}},
    "required": ["name", "age", "city", "skills"], "additionalProperties": False}
PRODUCT = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40}, "price": {"type": "number", "minimum": 0},
    "in_stock": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                              "maxItems": 5}},
    "required": ["title", "price", "in_stock", "tags"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 30},
                                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search_code", "description": "Search the repository's code",
                                      "parameters": {"type": "object", "properties": {
                                          "query": {"type": "string", "maxLength": 60},
                                          "max_results": {"type": "integer", "minimum": 1, "maximum": 20}},
                                          "required": ["query", "max_results"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite of a path",
                                      "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string", "maxLength": 60},
                                          "verbose": {"type": "boolean"}},
                                          "required": ["path", "verbose"], "additionalProperties": False}}},
]
PEOPLE = ["a retired teacher from Lyon", "a young engineer in Osaka", "a chef who moved to Lima",
          "a pilot based in Oslo", "a nurse in Toronto", "a painter from Porto", "a farmer near Krakow",
          "a student in Nairobi"]
PRODUCTS = ["a waterproof hiking backpack", "a mechanical keyboard", "an espresso machine", "a reading lamp",
            "running shoes", "a cast iron pan", "noise-cancelling headphones", "a folding bicycle"]
TASKS = ["What's the weather like in Madrid right now?", "Find where the tokenizer is loaded in the code.",
         "Run the tests in tests/test_server.py and show details.", "Is it raining in Seattle?",
         "Search the code for the function that parses JSON requests.", "Run the unit tests under tests/unit.",
         "How hot is it in Cairo today, in fahrenheit?", "Look for every use of the scheduler in the code."]
