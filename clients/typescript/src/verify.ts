// Standard Webhooks (https://www.standardwebhooks.com) verification of a voice-tools callback:
// `webhook-signature` holds one or more `v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">`
// separated by spaces (one per secret the server signs with: a rotation), keyed with the
// base64-decoded part of a `whsec_` secret.
import { createHmac, timingSafeEqual } from "node:crypto";

import type { CallbackEvent } from "./types.js";

export const DEFAULT_TOLERANCE_SECONDS = 300;
const SECRET_PREFIX = "whsec_";

/** Why a callback was refused. */
export class WebhookVerificationError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "WebhookVerificationError";
  }
}

/** Request headers as Node's `IncomingMessage.headers`, a fetch `Headers`, or any plain object. */
export type HeadersLike = Headers | Record<string, string | string[] | undefined>;

function header(headers: HeadersLike, name: string): string | undefined {
  if (typeof (headers as Headers).get === "function") {
    return (headers as Headers).get(name) ?? undefined;
  }
  const lowered = name.toLowerCase();
  for (const [key, value] of Object.entries(headers as Record<string, string | string[] | undefined>)) {
    if (key.toLowerCase() === lowered) {
      return Array.isArray(value) ? value.join(", ") : value;
    }
  }
  return undefined;
}

function secretKey(secret: string): Buffer {
  const encoded = secret.startsWith(SECRET_PREFIX) ? secret.slice(SECRET_PREFIX.length) : secret;
  if (!/^[A-Za-z0-9+/]+={0,2}$/.test(encoded)) {
    throw new WebhookVerificationError("a secret is not whsec_ followed by base64");
  }
  return Buffer.from(encoded, "base64");
}

/**
 * Check a callback's Standard Webhooks signature and return its event.
 *
 * `body` is the raw body as received (a string or the bytes); `secrets` one `whsec_` secret or
 * several (a relay during a rotation holds the new and the old). Throws
 * `WebhookVerificationError` when a header is missing or malformed, the timestamp is more than
 * `toleranceSeconds` away from `now` (Unix seconds; the clock by default), or no signature
 * matches any secret (compared in constant time).
 */
export function verify(
  headers: HeadersLike,
  body: string | Uint8Array,
  secrets: string | readonly string[],
  toleranceSeconds: number = DEFAULT_TOLERANCE_SECONDS,
  now: number = Date.now() / 1000,
): CallbackEvent {
  const keys = (typeof secrets === "string" ? [secrets] : [...secrets]).filter((s) => s).map(secretKey);
  if (keys.length === 0) {
    throw new WebhookVerificationError("no secret to verify with");
  }
  const msgId = header(headers, "webhook-id");
  const timestamp = header(headers, "webhook-timestamp");
  const signature = header(headers, "webhook-signature");
  if (!msgId || !timestamp || !signature) {
    throw new WebhookVerificationError("missing webhook-id, webhook-timestamp or webhook-signature");
  }
  if (!/^[0-9]+$/.test(timestamp)) {
    throw new WebhookVerificationError("webhook-timestamp is not Unix seconds");
  }
  if (Math.abs(now - Number(timestamp)) > toleranceSeconds) {
    throw new WebhookVerificationError("webhook-timestamp is outside the tolerance window");
  }
  const raw = typeof body === "string" ? Buffer.from(body, "utf8") : Buffer.from(body);
  const signed = Buffer.concat([Buffer.from(`${msgId}.${timestamp}.`, "utf8"), raw]);
  const given: Buffer[] = [];
  for (const part of signature.split(" ")) {
    const comma = part.indexOf(",");
    if (comma < 0 || part.slice(0, comma) !== "v1") continue;
    given.push(Buffer.from(part.slice(comma + 1), "base64"));
  }
  for (const key of keys) {
    const expected = createHmac("sha256", key).update(signed).digest();
    for (const candidate of given) {
      if (candidate.length === expected.length && timingSafeEqual(candidate, expected)) {
        return JSON.parse(raw.toString("utf8")) as CallbackEvent;
      }
    }
  }
  throw new WebhookVerificationError("no signature matches");
}
