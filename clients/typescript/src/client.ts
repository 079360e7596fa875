// The REST calls of voice-tools and its event stream, over Node's own fetch.
import { randomUUID } from "node:crypto";

import type { CallbackEvent, ErrorBody, operations, Schemas } from "./types.js";

type JsonBody<Op extends keyof operations> = operations[Op] extends {
  requestBody?: { content: { "application/json": infer B } };
}
  ? B
  : never;

/** The body of `pending` (and of `execute`): one variant per tool, chosen by `function`. */
export type PendingRequest = JsonBody<"pending">;
export type ExecuteRequest = JsonBody<"execute">;
export type CallRecord = Schemas["CallRecord"];
// eslint-disable-next-line @typescript-eslint/no-explicit-any
export type Json = Record<string, any>;

/** A voice-tools error answer: `{error, message, details}` with its HTTP status. */
export class VoiceToolsError extends Error {
  readonly status: number;
  readonly error: string;
  readonly details: Record<string, unknown>;

  constructor(status: number, body: ErrorBody) {
    super(body.message);
    this.name = "VoiceToolsError";
    this.status = status;
    this.error = body.error;
    this.details = (body.details ?? {}) as Record<string, unknown>;
  }
}

export interface ClientOptions {
  /** How many times a 503 or 429 answer is retried (default 3). */
  retries?: number;
  /** The longest wait between two tries, in seconds, whatever Retry-After says (default 10). */
  maxRetryDelaySeconds?: number;
  /** Milliseconds before the first reconnection of an event stream when the server gave no `retry:` (default 2000). */
  reconnectDelayMs?: number;
}

export interface FollowOptions {
  /** Resume after this event (its `event_id`): only later events are yielded. */
  lastEventId?: string;
  /** Stops the stream (the iterator ends). */
  signal?: AbortSignal;
}

const sleep = (ms: number, signal?: AbortSignal) =>
  new Promise<void>((resolve) => {
    if (signal?.aborted) return resolve();
    const timer = setTimeout(resolve, ms);
    signal?.addEventListener("abort", () => {
      clearTimeout(timer);
      resolve();
    }, { once: true });
  });

export class Client {
  readonly baseUrl: string;
  private readonly token: string;
  private readonly retries: number;
  private readonly maxRetryDelaySeconds: number;
  private readonly reconnectDelayMs: number;

  constructor(baseUrl: string, token: string, options: ClientOptions = {}) {
    this.baseUrl = baseUrl.replace(/\/+$/, "");
    this.token = token;
    this.retries = options.retries ?? 3;
    this.maxRetryDelaySeconds = options.maxRetryDelaySeconds ?? 10;
    this.reconnectDelayMs = options.reconnectDelayMs ?? 2000;
  }

  /** Record a call (PENDING). An idempotency key is made when none is given, so a retry makes no second call. */
  pending(body: PendingRequest, options: { idempotencyKey?: string } = {}): Promise<Json> {
    return this.request("POST", "/voice-tools/pending", {
      body, headers: { "Idempotency-Key": options.idempotencyKey ?? randomUUID() },
    });
  }

  /** Correct a PENDING call's parameters (merged; null removes a field). */
  modify(toolCallId: string, parameters: Json): Promise<Json> {
    return this.request("PATCH", `/voice-tools/modify/${enc(toolCallId)}`, { body: { parameters } });
  }

  /** Start a PENDING call; with `wait` (seconds, ≤ 30) answer once it reaches PREPARED or ends. */
  confirm(toolCallId: string, options: { wait?: number; callbackUrl?: string; callbackUrls?: Json } = {}): Promise<Json> {
    const body: Json = {};
    if (options.callbackUrl !== undefined) body.callback_url = options.callbackUrl;
    if (options.callbackUrls !== undefined) body.callback_urls = options.callbackUrls;
    return this.request("POST", `/voice-tools/confirm/${enc(toolCallId)}`, { body, wait: options.wait });
  }

  /** Answer a checkpoint: `proceed` or `cancel`. */
  resume(toolCallId: string, action: "proceed" | "cancel", options: { wait?: number; reason?: string } = {}): Promise<Json> {
    const body: Json = { action };
    if (options.reason !== undefined) body.reason = options.reason;
    return this.request("POST", `/voice-tools/resume/${enc(toolCallId)}`, { body, wait: options.wait });
  }

  /** Cancel a call before its point of no return (409 `too_late` after). */
  cancel(toolCallId: string, reason?: string): Promise<Json> {
    return this.request("DELETE", `/voice-tools/cancel/${enc(toolCallId)}`, {
      body: reason === undefined ? undefined : { reason },
    });
  }

  /** Record and start a call the caller already agreed to. An idempotency key is made when none is given. */
  execute(body: ExecuteRequest, options: { wait?: number; idempotencyKey?: string } = {}): Promise<Json> {
    return this.request("POST", "/voice-tools/execute", {
      body, wait: options.wait, headers: { "Idempotency-Key": options.idempotencyKey ?? randomUUID() },
    });
  }

  /** A session's open calls and its last `limit` finished ones. */
  context(sessionId: string, limit?: number): Promise<Json> {
    const query = limit === undefined ? "" : `?limit=${limit}`;
    return this.request("GET", `/voice-tools/context/${enc(sessionId)}${query}`);
  }

  /** A call's whole record. */
  status(toolCallId: string): Promise<CallRecord & Json> {
    return this.request("GET", `/voice-tools/status/${enc(toolCallId)}`) as Promise<CallRecord & Json>;
  }

  /** One request; 503 and 429 are tried again (after Retry-After, bounded), other errors thrown. */
  async request(method: string, path: string, options: { body?: unknown; wait?: number; headers?: Record<string, string> } = {}): Promise<Json> {
    const url = this.baseUrl + path + (options.wait !== undefined ? `${path.includes("?") ? "&" : "?"}wait=${options.wait}` : "");
    const headers: Record<string, string> = { Authorization: `Bearer ${this.token}`, ...options.headers };
    if (options.body !== undefined) headers["Content-Type"] = "application/json";
    for (let attempt = 0; ; attempt++) {
      const answer = await fetch(url, {
        method, headers, body: options.body === undefined ? undefined : JSON.stringify(options.body),
      });
      const parsed = await body(answer);
      if (answer.ok) return parsed as Json;
      if ((answer.status === 503 || answer.status === 429) && attempt < this.retries) {
        await sleep(this.retryDelay(answer, attempt) * 1000);
        continue;
      }
      throw new VoiceToolsError(answer.status, parsed as ErrorBody);
    }
  }

  private retryDelay(answer: Response, attempt: number): number {
    const given = Number(answer.headers.get("Retry-After"));
    const delay = Number.isFinite(given) && given > 0 ? given : 0.5 * 2 ** attempt;
    return Math.min(delay, this.maxRetryDelaySeconds);
  }

  /**
   * The session's events, as an async iterator: past ones first, then new ones as they are
   * recorded. A dropped connection is reopened with `Last-Event-ID`, so no event is lost or
   * repeated. Leave the `for await` loop (or abort `signal`) to close the stream.
   */
  async *follow(sessionId: string, options: FollowOptions = {}): AsyncGenerator<CallbackEvent, void, undefined> {
    let lastEventId = options.lastEventId;
    let reconnectMs = this.reconnectDelayMs;
    let failures = 0;
    while (!options.signal?.aborted) {
      const controller = new AbortController();
      const stop = () => controller.abort();
      options.signal?.addEventListener("abort", stop, { once: true });
      try {
        const headers: Record<string, string> = { Authorization: `Bearer ${this.token}`, Accept: "text/event-stream" };
        if (lastEventId !== undefined) headers["Last-Event-ID"] = lastEventId;
        let answer: Response;
        try {
          answer = await fetch(`${this.baseUrl}/voice-tools/events/${enc(sessionId)}`, { headers, signal: controller.signal });
        } catch (error) {
          if (options.signal?.aborted) return;
          if (++failures > this.retries) throw error;
          await sleep(reconnectMs, options.signal);
          continue;
        }
        if (!answer.ok) {
          const parsed = await body(answer);
          if ((answer.status === 503 || answer.status === 429) && ++failures <= this.retries) {
            await sleep(this.retryDelay(answer, failures - 1) * 1000, options.signal);
            continue;
          }
          throw new VoiceToolsError(answer.status, parsed as ErrorBody);
        }
        failures = 0;
        try {
          for await (const frame of frames(answer.body!)) {
            if (frame.retry !== undefined) reconnectMs = frame.retry;
            if (frame.data === undefined) continue;
            if (frame.id !== undefined) lastEventId = frame.id;
            yield JSON.parse(frame.data) as CallbackEvent;
          }
        } catch (error) {
          if (options.signal?.aborted) return;
          // a dropped connection: reopened below after the server's retry hint
        }
        await sleep(reconnectMs, options.signal);
      } finally {
        options.signal?.removeEventListener("abort", stop);
        controller.abort();
      }
    }
  }
}

interface Frame {
  id?: string;
  event?: string;
  data?: string;
  retry?: number;
}

/** Server-Sent Events frames from a byte stream (the WHATWG rules: lines end in \n, \r\n or \r;
 * a blank line ends a frame; a frame cut off by the end of the stream is dropped). */
export async function* frames(body: ReadableStream<Uint8Array>): AsyncGenerator<Frame> {
  const decoder = new TextDecoder();
  let buffer = "";
  let frame: Frame = {};
  let data: string[] = [];
  for await (const chunk of body as unknown as AsyncIterable<Uint8Array>) {
    buffer += decoder.decode(chunk, { stream: true });
    let match: RegExpExecArray | null;
    const lineEnd = /\r\n|\n|\r/g;
    let start = 0;
    while ((match = lineEnd.exec(buffer)) !== null) {
      if (match[0] === "\r" && match.index === buffer.length - 1) break; // may be the first half of \r\n
      const line = buffer.slice(start, match.index);
      start = match.index + match[0].length;
      if (line === "") {
        if (data.length > 0) frame.data = data.join("\n");
        if (frame.data !== undefined || frame.retry !== undefined) yield frame;
        frame = {};
        data = [];
        continue;
      }
      if (line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "data") data.push(value);
      else if (field === "id") frame.id = value;
      else if (field === "event") frame.event = value;
      else if (field === "retry" && /^[0-9]+$/.test(value)) frame.retry = Number(value);
    }
    buffer = buffer.slice(start);
  }
}

const enc = encodeURIComponent;

/** An answer's JSON body; a body that is not JSON (a proxy's error page) becomes an `http_error`. */
async function body(answer: Response): Promise<unknown> {
  const text = await answer.text();
  if (!text) return answer.ok ? {} : { error: "http_error", message: answer.statusText, details: {} };
  try {
    const parsed = JSON.parse(text);
    if (answer.ok || (parsed !== null && typeof parsed === "object" && typeof parsed.error === "string")) return parsed;
  } catch {
    // not JSON: below
  }
  return { error: "http_error", message: `${answer.status} ${answer.statusText}: not a voice-tools answer`, details: { body: text.slice(0, 500) } };
}
