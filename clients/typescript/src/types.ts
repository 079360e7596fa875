// Types generated from the API's OpenAPI document (`npm run generate` writes src/openapi.ts
// from openapi.json, a copy of /openapi.json kept equal to it by the repository's tests).
import type { components, operations } from "./openapi.js";

export type { components, operations };
export type Schemas = components["schemas"];

/** Any event a callback or the event stream carries, discriminated by `event`. */
export type CallbackEvent = Schemas["CallbackEvent"];
export type ProgressEvent = Schemas["ProgressEvent"];
export type CheckpointEvent = Schemas["CheckpointEvent"];
export type CompletedEvent = Schemas["CompletedEvent"];
export type FailedEvent = Schemas["FailedEvent"];
export type CancelledEvent = Schemas["CancelledEvent"];
export type ExpiredEvent = Schemas["ExpiredEvent"];
export type EventKind = CallbackEvent["event"];

/** An error answer: `{error, message, details}`. */
export interface ErrorBody {
  error: string;
  message: string;
  details?: Record<string, unknown>;
}
