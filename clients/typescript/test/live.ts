// The client against a live voice-tools API, run by tests/test_typescript_client.py:
//   node dist/test/live.js walkthrough   (env API_URL, API_TOKEN, RELAY_URL, SESSION)
//   node dist/test/live.js verify FILE   (FILE: {callbacks: [{headers, body}], secrets: [new, old]})
//   node dist/test/live.js stream        (env API_URL, API_TOKEN, SESSION, EXPECTED: the event count)
//   node dist/test/live.js retries       (against a local HTTP double: 503/429 retried, Retry-After bounded)
// Each prints one JSON line of what it saw and exits 0, or fails an assertion (exit 1).
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import net from "node:net";

import { Client, verify, VoiceToolsError, WebhookVerificationError } from "../src/index.js";
import type { CallbackEvent } from "../src/index.js";

const env = (name: string): string => {
  const value = process.env[name];
  assert.ok(value, `${name} is not set`);
  return value;
};

async function walkthrough(): Promise<unknown> {
  const client = new Client(env("API_URL"), env("API_TOKEN"));
  const session = env("SESSION");
  const callbackUrl = env("RELAY_URL");
  const body = {
    session_id: session, function: "send_email" as const, callback_url: callbackUrl,
    parameters: { to: "john@example.com", subject: "Meeting Tomorrow" },
  };
  const recorded = await client.pending(body, { idempotencyKey: "ts-walkthrough-1" });
  assert.equal(recorded.status, "PENDING");
  assert.match(recorded.confirmation_message, /john@example\.com/);
  const replay = await client.pending(body, { idempotencyKey: "ts-walkthrough-1" });
  assert.equal(replay.tool_call_id, recorded.tool_call_id, "a replayed idempotency key makes no second call");
  const id: string = recorded.tool_call_id;

  const modified = await client.modify(id, { to: "john.smith@example.com" });
  assert.deepEqual(modified.changes, [{ field: "to", old: "john@example.com", new: "john.smith@example.com" }]);
  const prepared = await client.confirm(id, { wait: 20 });
  assert.equal(prepared.status, "PREPARED");
  assert.deepEqual(prepared.actions_available, ["proceed", "cancel"]);
  const done = await client.resume(id, "proceed", { wait: 20 });
  assert.equal(done.status, "COMPLETED");
  assert.equal(done.voice_response, "Email sent to john.smith@example.com.");
  const status = await client.status(id);
  assert.equal(status.status, "COMPLETED");
  assert.equal(status.outcome, "done");

  // a second call, cancelled before it starts
  const other = await client.pending({ ...body, parameters: { to: "ann@example.com", subject: "Hi" } });
  const cancelled = await client.cancel(other.tool_call_id, "changed my mind");
  assert.equal(cancelled.status, "CANCELLED");
  const context = await client.context(session);
  assert.deepEqual(new Set(context.recent.map((c: { tool_call_id: string }) => c.tool_call_id)),
    new Set([id, other.tool_call_id]));

  // errors are VoiceToolsError with the API's error, message and details
  await assert.rejects(client.resume(id, "proceed"), (error: unknown) => {
    assert.ok(error instanceof VoiceToolsError && error instanceof Error);
    assert.equal(error.status, 409);
    assert.equal(error.error, "already_terminal");
    assert.ok(error.message.length > 0);
    return true;
  });
  await assert.rejects(client.modify("tc_000000000000", { to: "x@example.com" }), (error: unknown) => {
    assert.ok(error instanceof VoiceToolsError);
    assert.equal(error.status, 404);
    assert.equal(error.error, "not_found");
    return true;
  });
  await assert.rejects(
    client.pending({ session_id: session, function: "send_email", parameters: { to: "not an address", subject: "x" } }),
    (error: unknown) => {
      assert.ok(error instanceof VoiceToolsError);
      assert.equal(error.error, "validation_error");
      assert.match(error.message, /parameters\.to/);
      assert.ok("to" in (error.details.fields as Record<string, Record<string, unknown>>).parameters, JSON.stringify(error.details));
      return true;
    });

  // execute: recorded and started at once, stopping at its checkpoint; replayed with its key, the same call
  const started = await client.execute({ ...body, parameters: { to: "bo@example.com", subject: "Hey" } },
    { wait: 20, idempotencyKey: "ts-walkthrough-execute" });
  assert.equal(started.status, "PREPARED");
  const again = await client.execute({ ...body, parameters: { to: "bo@example.com", subject: "Hey" } },
    { idempotencyKey: "ts-walkthrough-execute" });
  assert.equal(again.tool_call_id, started.tool_call_id);
  const dropped = await client.resume(started.tool_call_id, "cancel", { wait: 20, reason: "not now" });
  assert.equal(dropped.status, "CANCELLED");
  assert.equal(dropped.voice_response, "Cancelled. The email was not sent.");
  return { tool_call_id: id, cancelled: [other.tool_call_id, started.tool_call_id] };
}

function verifyCallbacks(file: string): unknown {
  const { callbacks, secrets } = JSON.parse(readFileSync(file, "utf8")) as {
    callbacks: { headers: Record<string, string>; body: string }[]; secrets: string[];
  };
  assert.ok(callbacks.length >= 4, "the walkthrough's callbacks");
  const [newSecret, oldSecret] = secrets;
  const refused = (thunk: () => unknown) => assert.throws(thunk, WebhookVerificationError);
  const kinds: string[] = [];
  for (const { headers, body } of callbacks) {
    assert.equal(headers["webhook-signature"].split(" ").length, 2, "one signature per secret during a rotation");
    const expected = JSON.parse(body);
    // a relay holding the new secret, the old one, or both
    for (const held of [newSecret, oldSecret, [newSecret, oldSecret]]) {
      const event: CallbackEvent = verify(headers, body, held);
      assert.deepEqual(event, expected);
    }
    assert.deepEqual(verify(headers, Buffer.from(body, "utf8"), oldSecret), expected);
    kinds.push(expected.event);
    // a secret the server does not sign with
    refused(() => verify(headers, body, "whsec_" + Buffer.alloc(32, 7).toString("base64")));
    // a tampered body: one character changed
    refused(() => verify(headers, body.replace(expected.tool_call_id, expected.tool_call_id.slice(0, -1) + "x"), newSecret));
    refused(() => verify(headers, body + " ", newSecret));
    // another event's id with this body
    refused(() => verify({ ...headers, "webhook-id": "0".repeat(32) }, body, newSecret));
    // a stale or future timestamp: outside the window, refused; inside it, accepted
    const sentAt = Number(headers["webhook-timestamp"]);
    refused(() => verify(headers, body, newSecret, 300, sentAt + 301));
    refused(() => verify(headers, body, newSecret, 300, sentAt - 301));
    assert.deepEqual(verify(headers, body, newSecret, 300, sentAt + 299), expected);
    refused(() => verify(headers, body, newSecret, 60, sentAt + 61));
    // a changed timestamp breaks the signature
    refused(() => verify({ ...headers, "webhook-timestamp": String(sentAt + 1) }, body, newSecret));
    // headers missing
    refused(() => verify({ "webhook-id": headers["webhook-id"] }, body, newSecret));
  }
  return { kinds };
}

/** A TCP proxy in front of the API that cuts the first connection in the middle of the stream's second event. */
async function cuttingProxy(target: URL) {
  const seen: { lastEventId: string | null }[] = [];
  const sockets = new Set<net.Socket>();
  const server = net.createServer((downstream) => {
    sockets.add(downstream);
    const index = seen.length;
    const record = { lastEventId: null as string | null };
    seen.push(record);
    const upstream = net.connect(Number(target.port), target.hostname);
    let request = "";
    downstream.on("data", (chunk) => {
      request += chunk.toString("latin1");
      const header = /^last-event-id: *(.*?)\r$/im.exec(request);
      if (header) record.lastEventId = header[1];
      upstream.write(chunk);
    });
    let answer = Buffer.alloc(0);
    upstream.on("data", (chunk: Buffer) => {
      if (index !== 0) return void downstream.write(chunk);
      answer = Buffer.concat([answer, chunk]);
      const text = answer.toString("latin1");
      const first = text.indexOf("\nevent: ");
      const second = first < 0 ? -1 : text.indexOf("\nevent: ", first + 1);
      if (second < 0) return;
      // forward everything up to the middle of the second event's frame, then drop both sides
      downstream.end(answer.subarray(0, second + 12), () => downstream.destroy());
      upstream.destroy();
    });
    const close = () => { upstream.destroy(); downstream.destroy(); };
    upstream.on("error", close);
    downstream.on("error", close);
    upstream.on("close", () => downstream.end());
    downstream.on("close", close);
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const port = (server.address() as net.AddressInfo).port;
  return { url: `http://127.0.0.1:${port}`, seen, close: () => { server.close(); for (const s of sockets) s.destroy(); } };
}

async function take(iterator: AsyncIterable<CallbackEvent>, count: number): Promise<CallbackEvent[]> {
  const got: CallbackEvent[] = [];
  if (count === 0) return got;
  for await (const event of iterator) {
    got.push(event);
    if (got.length === count) break; // leaving the loop closes the stream
  }
  return got;
}

async function stream(): Promise<unknown> {
  const session = env("SESSION");
  const expected = Number(env("EXPECTED"));
  const token = env("API_TOKEN");
  const direct = await take(new Client(env("API_URL"), token).follow(session), expected);
  const ids = direct.map((event) => event.event_id);
  assert.equal(new Set(ids).size, expected);

  const proxy = await cuttingProxy(new URL(env("API_URL")));
  try {
    const client = new Client(proxy.url, token, { reconnectDelayMs: 100 });
    const resumed = await take(client.follow(session), expected);
    assert.ok(proxy.seen.length >= 2, "the first connection was dropped and another opened");
    assert.equal(proxy.seen[0].lastEventId, null);
    assert.equal(proxy.seen[1].lastEventId, ids[0], "the second connection resumes after the last whole event");
    assert.deepEqual(resumed.map((event) => event.event_id), ids, "no event lost or repeated");
    assert.deepEqual(resumed, direct);
  } finally {
    proxy.close();
  }

  // resuming from an event the caller already has: only the later ones
  const later = await take(new Client(env("API_URL"), token).follow(session, { lastEventId: ids[1] }), expected - 2);
  assert.deepEqual(later.map((event) => event.event_id), ids.slice(2));
  // an id that is not the session's: the API's 422, thrown
  await assert.rejects(take(new Client(env("API_URL"), token).follow(session, { lastEventId: "f".repeat(32) }), 1),
    (error: unknown) => error instanceof VoiceToolsError && error.status === 422);
  return { ids, kinds: direct.map((event) => event.event) };
}

/** 503 and 429 are tried again after Retry-After (bounded), with the same idempotency key; then thrown.
 * Against a local HTTP double that answers as programmed (no API needed). */
async function retries(): Promise<unknown> {
  const { createServer } = await import("node:http");
  const seen: { at: number; key: string | undefined; path: string }[] = [];
  let script: { status: number; retryAfter?: string; body: unknown }[] = [];
  const server = createServer((request, response) => {
    seen.push({ at: Date.now(), key: request.headers["idempotency-key"] as string | undefined, path: request.url! });
    const next = script.shift() ?? { status: 500, body: { error: "unexpected", message: "no more answers" } };
    const headers: Record<string, string> = { "Content-Type": "application/json" };
    if (next.retryAfter) headers["Retry-After"] = next.retryAfter;
    request.resume();
    request.on("end", () => { response.writeHead(next.status, headers); response.end(typeof next.body === "string" ? next.body : JSON.stringify(next.body)); });
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const url = `http://127.0.0.1:${(server.address() as net.AddressInfo).port}`;
  const busy = { error: "unavailable", message: "The database is unavailable.", details: {} };
  const full = { error: "too_many_open", message: "Too many open.", details: { retry_after: 1 } };
  try {
    const client = new Client(url, "t", { retries: 3, maxRetryDelaySeconds: 1 });
    script = [{ status: 503, retryAfter: "1", body: busy }, { status: 429, retryAfter: "3600", body: full },
      { status: 201, body: { tool_call_id: "tc_000000000001", status: "PENDING" } }];
    const recorded = await client.pending({ session_id: "s", function: "send_email", parameters: { to: "a@example.com", subject: "x" } });
    assert.equal(recorded.tool_call_id, "tc_000000000001");
    assert.equal(seen.length, 3);
    assert.ok(seen[0].key && seen.every((s) => s.key === seen[0].key), "one idempotency key on every try");
    for (const [a, b] of [[0, 1], [1, 2]]) {
      const gap = seen[b].at - seen[a].at;
      assert.ok(gap >= 900 && gap < 2500, `Retry-After honoured and bounded: ${gap} ms`);
    }
    seen.length = 0;
    script = Array.from({ length: 4 }, () => ({ status: 503, retryAfter: "0", body: busy }));
    await assert.rejects(new Client(url, "t", { retries: 3, maxRetryDelaySeconds: 0.05 }).confirm("tc_000000000001"),
      (error: unknown) => error instanceof VoiceToolsError && error.status === 503 && error.error === "unavailable"
        && error.message === busy.message);
    assert.equal(seen.length, 4, "three retries, then the error");
    seen.length = 0;
    script = [{ status: 409, body: { error: "too_late", message: "Too late.", details: { status: "EXECUTING" } } }];
    await assert.rejects(new Client(url, "t").cancel("tc_000000000001"),
      (error: unknown) => error instanceof VoiceToolsError && error.error === "too_late"
        && (error.details as { status: string }).status === "EXECUTING");
    assert.equal(seen.length, 1, "a 409 is not retried");
    script = [{ status: 502, body: "<html>Bad Gateway</html>" }];
    await assert.rejects(new Client(url, "t").status("tc_000000000001"),
      (error: unknown) => error instanceof VoiceToolsError && error.status === 502 && error.error === "http_error");
    return { ok: true };
  } finally {
    server.close();
  }
}

const [mode, arg] = process.argv.slice(2);
const run = mode === "walkthrough" ? walkthrough() : mode === "verify" ? Promise.resolve(verifyCallbacks(arg))
  : mode === "stream" ? stream() : mode === "retries" ? retries() : Promise.reject(new Error(`unknown mode ${mode}`));
run.then((result) => {
  console.log(JSON.stringify(result));
  process.exit(0); // whatever sockets the dropped streams left behind
}, (error) => {
  console.error(error);
  process.exit(1);
});
