"""Real client libraries against the live server: the official ``openai`` SDK, and the
frameworks langchain-openai and pydantic-ai (optional test dependencies, skipped when
not installed).

Each runs a tool round trip (a forced call whose arguments the library parses into
its own objects, the tool's result sent back, the model answering again) and
structured output through the library's own API. The model is random, so the
schemas are bounded (``Literal``, ``max_length``, ranges: see
test_api_forced_calls.py), ``｜DSML｜`` is favoured so the marker is one token,
and temperature is 0: what is under test is that each library gets what it
parses, not what the model says.
"""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from api_helpers import API_KEY, LiveServer
from pydantic import BaseModel, Field

DSML_AS_ONE_TOKEN = {"128825": 100}
ASK = "What is the weather in Paris for the next three days?"


class GetWeather(BaseModel):
    """Weather forecast for a city."""

    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=7)


class Forecast(BaseModel):
    sunny: bool
    high: int = Field(ge=-20, le=45)
    summary: str = Field(max_length=8)


def forecast_text(call: GetWeather) -> str:
    return json.dumps({"city": call.city, "days": call.days, "sky": "clear", "high": 21})


# ------------------------------------------------------------------ openai


def test_openai_parse_tool_round_trip(client: openai.OpenAI) -> None:
    """``chat.completions.parse`` with ``pydantic_function_tool``: arguments parsed into
    the model class (strict tools), the result sent back, a second answer."""
    messages: list = [{"role": "user", "content": ASK}]
    tools = [openai.pydantic_function_tool(GetWeather)]
    first = client.chat.completions.parse(
        model="deepseek-chat",
        messages=messages,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "GetWeather"}},
        temperature=0,
        max_tokens=300,
        logit_bias=DSML_AS_ONE_TOKEN,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    parsed = call.function.parsed_arguments
    assert isinstance(parsed, GetWeather)
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": forecast_text(parsed)},
    ]
    second = client.chat.completions.create(
        model="deepseek-chat", messages=messages, tools=tools, max_tokens=8
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the history was read


def test_openai_parse_structured_output(client: openai.OpenAI) -> None:
    r = client.chat.completions.parse(
        model="deepseek-chat",
        messages=[{"role": "user", "content": "Forecast for Paris as JSON."}],
        response_format=Forecast,
        temperature=0,
        max_tokens=120,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Forecast)
    assert " " not in choice.message.content.replace(choice.message.parsed.summary, "")  # compact


# ---------------------------------------------------------- langchain-openai


@pytest.fixture(scope="module")
def chat_openai(live_server: LiveServer):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(
        model="deepseek-chat",
        base_url=live_server.base_url + "/v1",
        api_key=API_KEY,
        temperature=0,
        max_tokens=300,
        logit_bias=DSML_AS_ONE_TOKEN,
    )


def test_langchain_bind_tools_round_trip(chat_openai) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = chat_openai.bind_tools([GetWeather], tool_choice="GetWeather")
    messages = [HumanMessage(ASK)]
    ai = llm.invoke(messages)
    (call,) = ai.tool_calls
    assert call["name"] == "GetWeather"
    parsed = GetWeather.model_validate(call["args"])
    assert ai.response_metadata["finish_reason"] == "tool_calls"
    messages += [ai, ToolMessage(forecast_text(parsed), tool_call_id=call["id"])]
    answer = chat_openai.bind(max_tokens=8).invoke(messages)
    assert answer.response_metadata["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_with_structured_output(chat_openai, method: str) -> None:
    structured = chat_openai.with_structured_output(Forecast, method=method)
    result = structured.invoke("Forecast for Paris.")
    assert isinstance(result, Forecast)


# --------------------------------------------------------------- pydantic-ai


def test_pydantic_ai_agent_with_a_tool_and_structured_output(live_server: LiveServer) -> None:
    """An agent whose output type is ``GetWeather`` (pydantic-ai asks for it as a
    forced tool call, ``final_result``) with a tool of its own, offered until it has
    run once: the run ends with a validated ``GetWeather`` after at most one tool
    round trip (greedy decoding of this checkpoint takes the tool first)."""
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent, RunContext
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings
    from pydantic_ai.tools import ToolDefinition

    model = OpenAIChatModel(
        "deepseek-chat",
        provider=OpenAIProvider(base_url=live_server.base_url + "/v1", api_key=API_KEY),
    )
    settings = ModelSettings(
        temperature=0, max_tokens=200, logit_bias=DSML_AS_ONE_TOKEN, parallel_tool_calls=False
    )
    agent = Agent(model, output_type=GetWeather, model_settings=settings)
    calls: list[str] = []

    async def until_called(ctx: RunContext, tool: ToolDefinition) -> ToolDefinition | None:
        return None if calls else tool

    @agent.tool_plain(prepare=until_called)
    def city_of_the_day() -> str:
        """The city to report on."""
        calls.append("city_of_the_day")
        return "Paris"

    result = agent.run_sync(ASK)
    assert isinstance(result.output, GetWeather)
    assert 1 <= result.output.days <= 7
    assert len(calls) <= 1
    # One model call per tool round trip, then the final_result call.
    responses = [m for m in result.all_messages() if m.kind == "response"]
    assert len(responses) == 1 + len(calls)
