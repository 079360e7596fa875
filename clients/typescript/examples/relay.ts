// An example relay, written with the client only: an OpenAI Realtime function call comes in,
// voice-tools records it, the caller says "yes", the call runs to its checkpoint (announced from
// the event stream), the caller's second answer resumes or cancels it, and the voice_response is
// what the assistant says last, handed back to Realtime as the function call's output.
//
//   VOICE_TOOLS_URL=http://127.0.0.1:8000 VOICE_TOOLS_TOKEN=... node dist/examples/relay.js yes yes
//
// The caller's answers are the arguments ("yes" / anything else); the function call is read from
// stdin when one is piped in, else the sample below is used. Each line printed is one JSON object:
// what the assistant says ({"say": ...}) and the Realtime event sent back at the end.
import { randomUUID } from "node:crypto";

import { Client, VoiceToolsError } from "../src/index.js";
import type { PendingRequest } from "../src/index.js";

/** A Realtime API `response.function_call_arguments.done` event, as the model sends it. */
interface RealtimeFunctionCall {
  type: "response.function_call_arguments.done";
  call_id: string;
  name: string;
  arguments: string;
}

const SAMPLE: RealtimeFunctionCall = {
  type: "response.function_call_arguments.done",
  call_id: `call_${randomUUID().replaceAll("-", "").slice(0, 16)}`,
  name: "send_email",
  arguments: JSON.stringify({ to: "john@example.com", subject: "Meeting Tomorrow", body: "See you at ten." }),
};

const say = (sentence: string) => console.log(JSON.stringify({ say: sentence }));

async function readStdin(): Promise<string> {
  if (process.stdin.isTTY) return "";
  let text = "";
  for await (const chunk of process.stdin) text += chunk;
  return text.trim();
}

export async function relay(client: Client, sessionId: string, call: RealtimeFunctionCall, answers: string[]) {
  const yes = (answer: string | undefined) => /^\s*(yes|yeah|sure|ok(ay)?)\b/i.test(answer ?? "");
  // 1. record the call; the Realtime call_id is the idempotency key, so a redelivered function call records nothing new
  const recorded = await client.pending(
    { session_id: sessionId, function: call.name, parameters: JSON.parse(call.arguments) } as PendingRequest,
    { idempotencyKey: call.call_id },
  );
  const id: string = recorded.tool_call_id;
  say(recorded.confirmation_message);

  let final;
  if (!yes(answers[0])) {
    final = await client.cancel(id, "The caller said no");
  } else {
    // 2. confirm; the checkpoint is announced from the session's event stream
    await client.confirm(id);
    let announced = false;
    for await (const event of client.follow(sessionId)) {
      if (event.tool_call_id !== id) continue;
      if (event.event === "checkpoint") {
        say(event.message ?? "Ready. Shall I go ahead?");
        announced = true;
        break;
      }
      if (["completed", "failed", "cancelled", "expired"].includes(event.event)) break; // no checkpoint (or it ended)
    }
    // 3. the caller's second answer: proceed or cancel, waiting for the end
    final = announced
      ? await client.resume(id, yes(answers[1]) ? "proceed" : "cancel", { wait: 20 })
      : await client.status(id);
  }
  // 4. what the assistant says, and the function call's output handed back to Realtime
  say(final.voice_response);
  const output = {
    type: "conversation.item.create",
    item: {
      type: "function_call_output", call_id: call.call_id,
      output: JSON.stringify({ tool_call_id: id, status: final.status, voice_response: final.voice_response }),
    },
  };
  console.log(JSON.stringify(output));
  return final;
}

async function main() {
  const url = process.env.VOICE_TOOLS_URL ?? "http://127.0.0.1:8000";
  const token = process.env.VOICE_TOOLS_TOKEN;
  if (!token) throw new Error("set VOICE_TOOLS_TOKEN");
  const input = await readStdin();
  const call = input ? (JSON.parse(input) as RealtimeFunctionCall) : SAMPLE;
  const sessionId = process.env.SESSION_ID ?? `relay_${randomUUID().slice(0, 8)}`;
  await relay(new Client(url, token), sessionId, call, process.argv.slice(2));
}

main().catch((error) => {
  if (error instanceof VoiceToolsError) console.error(`${error.status} ${error.error}: ${error.message}`, error.details);
  else console.error(error);
  process.exit(1);
});
