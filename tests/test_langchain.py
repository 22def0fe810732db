"""LangChain's OpenAI chat model against a real server on the shipped pair: with_structured_output into a
Pydantic model, bind_tools with a forced tool (arguments valid against the tool's schema), and the
Responses API (use_responses_api)."""

import jsonschema
import pytest
from fixtures import Served
from pydantic import BaseModel, Field

from flashdraft import LLM
from flashdraft.server.app import build_app

langchain_openai = pytest.importorskip("langchain_openai")


class City(BaseModel):
    """A city and its country."""

    name: str = Field(max_length=24)
    country: str = Field(max_length=24)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 24}},
                                                "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def url():
    served = Served(build_app(LLM(device="cpu", dtype="float32").engine))
    yield served.url + "/v1"
    served.close()


def _model(url, **kw):
    return langchain_openai.ChatOpenAI(base_url=url, api_key="unused", model="smollm2-135m-instruct", temperature=0,
                                       max_tokens=60, max_retries=0, timeout=300, **kw)


def test_with_structured_output(url):
    city = _model(url).with_structured_output(City, method="json_schema").invoke("Name a city in France.")
    assert isinstance(city, City) and city.name


def test_bind_tools_with_a_forced_tool(url):
    msg = _model(url).bind_tools([WEATHER], tool_choice="get_weather").invoke("What's the weather in Paris?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], WEATHER["function"]["parameters"])


def test_the_responses_api(url):
    msg = _model(url, use_responses_api=True).invoke("Say hi.")
    assert msg.text.strip()
