/*
 * A line-driven Aeron 1.15.1 publisher for slipstream's interop tests: it holds one publication
 * (typically a manual multi-destination-cast channel) and adds/removes destinations and offers
 * messages on command.  Aeron's samples never call Publication.addDestination, hence this program.
 *
 * Properties (-D):
 *   aeron.dir            the driver directory (read by Aeron's client context itself)
 *   mdc.channel          the publication channel, e.g. aeron:udp?control-mode=manual|control=127.0.0.1:40500
 *                        (the first program argument, when given, wins)
 *   mdc.streamId         stream id (default 10)
 *   mdc.messageLength    bytes per message, at least 8 (default 32)
 *   mdc.exclusive        true for an exclusive publication (default false)
 *   mdc.offerTimeoutMs   give up a "send" when no offer succeeded for this long (default 10000)
 *
 * stdin, one command a line; stdout, one line per command:
 *   add URI        -> "added URI"              Publication.addDestination(URI)
 *   remove URI     -> "removed URI"            Publication.removeDestination(URI)
 *   send N [EVERY] -> "sent N"                 offer N messages; the payload's first 8 bytes are the
 *                                              message index (little-endian int64, counted on across
 *                                              sends from 0), the rest zeros; back pressure, "not
 *                                              connected" and admin actions are retried; with EVERY,
 *                                              a claim of 1 + (index * 37) % 700 bytes (tryClaim, the
 *                                              payload filled with 0xFF) is given up with
 *                                              BufferClaim.abort before each message whose index
 *                                              it divides: padding of the claim's frame length
 *   connected      -> "connected true|false"   Publication.isConnected()
 *   position       -> "position P"             Publication.position()
 *   next           -> "next I"                 the index the next message will carry
 *   quit (or EOF)  -> "bye"                    closes the publication and the client, exits 0
 * Any command that throws prints "error <message>" (one line) instead.  At start, once the
 * publication exists: "ready sessionId=S streamId=I registrationId=R".
 */

import io.aeron.Aeron;
import io.aeron.Publication;
import io.aeron.logbuffer.BufferClaim;
import org.agrona.concurrent.UnsafeBuffer;

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.locks.LockSupport;

public final class MdcPublisher
{
    private final Publication publication;
    private final UnsafeBuffer buffer;
    private final BufferClaim claim = new BufferClaim();
    private final int messageLength;
    private final long offerTimeoutNs;
    private long nextIndex = 0;

    private MdcPublisher(final Publication publication, final int messageLength, final long offerTimeoutNs)
    {
        this.publication = publication;
        this.messageLength = messageLength;
        this.offerTimeoutNs = offerTimeoutNs;
        this.buffer = new UnsafeBuffer(ByteBuffer.allocateDirect(messageLength));
    }

    public static void main(final String[] args) throws Exception
    {
        final String channel = args.length > 0 ? args[0] : System.getProperty("mdc.channel");
        if (null == channel || channel.isEmpty())
        {
            System.err.println("usage: MdcPublisher CHANNEL (or -Dmdc.channel=CHANNEL)");
            System.exit(2);
        }

        final int streamId = Integer.getInteger("mdc.streamId", 10);
        final int messageLength = Integer.getInteger("mdc.messageLength", 32);
        final boolean exclusive = Boolean.getBoolean("mdc.exclusive");
        final long offerTimeoutNs = TimeUnit.MILLISECONDS.toNanos(Long.getLong("mdc.offerTimeoutMs", 10_000L));
        if (messageLength < 8)
        {
            System.err.println("mdc.messageLength must be at least 8");
            System.exit(2);
        }

        try (Aeron aeron = Aeron.connect(new Aeron.Context());
            Publication publication = exclusive ?
                aeron.addExclusivePublication(channel, streamId) : aeron.addPublication(channel, streamId))
        {
            reply("ready sessionId=" + publication.sessionId() + " streamId=" + publication.streamId() +
                " registrationId=" + publication.registrationId());

            final MdcPublisher publisher = new MdcPublisher(publication, messageLength, offerTimeoutNs);
            final BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
            String line;
            while (null != (line = in.readLine()))
            {
                line = line.trim();
                if (line.isEmpty())
                {
                    continue;
                }
                if ("quit".equals(line))
                {
                    break;
                }

                try
                {
                    reply(publisher.execute(line));
                }
                catch (final Exception ex)
                {
                    reply("error " + oneLine(ex));
                }
            }
        }

        reply("bye");
    }

    private String execute(final String line)
    {
        final int space = line.indexOf(' ');
        final String command = space < 0 ? line : line.substring(0, space);
        final String argument = space < 0 ? "" : line.substring(space + 1).trim();

        switch (command)
        {
            case "add":
                publication.addDestination(argument);
                return "added " + argument;

            case "remove":
                publication.removeDestination(argument);
                return "removed " + argument;

            case "send":
                final String[] sendParts = argument.split("\\s+");
                final long count = Long.parseLong(sendParts[0]);
                send(count, sendParts.length > 1 ? Long.parseLong(sendParts[1]) : 0);
                return "sent " + count;

            case "connected":
                return "connected " + publication.isConnected();

            case "position":
                return "position " + publication.position();

            case "next":
                return "next " + nextIndex;

            default:
                throw new IllegalArgumentException("unknown command: " + line);
        }
    }

    private void send(final long count, final long abortEvery)
    {
        for (long i = 0; i < count; i++)
        {
            if (abortEvery > 0 && nextIndex % abortEvery == 0)
            {
                abortClaim(1 + (int)(nextIndex * 37 % 700));
            }
            buffer.setMemory(0, messageLength, (byte)0);
            buffer.putLong(0, nextIndex, ByteOrder.LITTLE_ENDIAN);

            final long deadlineNs = System.nanoTime() + offerTimeoutNs;
            long result;
            while ((result = publication.offer(buffer, 0, messageLength)) < 0)
            {
                if (Publication.CLOSED == result || Publication.MAX_POSITION_EXCEEDED == result)
                {
                    throw new IllegalStateException(
                        "offer of message " + nextIndex + " failed: " + offerResult(result));
                }
                if (System.nanoTime() - deadlineNs > 0)
                {
                    throw new IllegalStateException("offer of message " + nextIndex + " still " +
                        offerResult(result) + " after " +
                        TimeUnit.NANOSECONDS.toMillis(offerTimeoutNs) + " ms (" + i + " of " + count + " sent)");
                }
                if (Publication.BACK_PRESSURED != result)
                {
                    LockSupport.parkNanos(TimeUnit.MILLISECONDS.toNanos(1));
                }
                else
                {
                    Thread.yield();
                }
            }

            nextIndex++;
        }
    }

    private void abortClaim(final int length)
    {
        final long deadlineNs = System.nanoTime() + offerTimeoutNs;
        long result;
        while ((result = publication.tryClaim(length, claim)) < 0)
        {
            if (Publication.CLOSED == result || Publication.MAX_POSITION_EXCEEDED == result)
            {
                throw new IllegalStateException("claim before message " + nextIndex + " failed: " +
                    offerResult(result));
            }
            if (System.nanoTime() - deadlineNs > 0)
            {
                throw new IllegalStateException("claim before message " + nextIndex + " still " +
                    offerResult(result) + " after " + TimeUnit.NANOSECONDS.toMillis(offerTimeoutNs) + " ms");
            }
            if (Publication.BACK_PRESSURED != result)
            {
                LockSupport.parkNanos(TimeUnit.MILLISECONDS.toNanos(1));
            }
            else
            {
                Thread.yield();
            }
        }

        claim.buffer().setMemory(claim.offset(), length, (byte)0xFF);
        claim.abort();
    }

    private static String offerResult(final long result)
    {
        if (Publication.NOT_CONNECTED == result)
        {
            return "NOT_CONNECTED";
        }
        if (Publication.BACK_PRESSURED == result)
        {
            return "BACK_PRESSURED";
        }
        if (Publication.ADMIN_ACTION == result)
        {
            return "ADMIN_ACTION";
        }
        if (Publication.CLOSED == result)
        {
            return "CLOSED";
        }
        if (Publication.MAX_POSITION_EXCEEDED == result)
        {
            return "MAX_POSITION_EXCEEDED";
        }
        return "result " + result;
    }

    private static String oneLine(final Throwable ex)
    {
        final String message = ex.getClass().getSimpleName() + ": " + ex.getMessage();
        return message.replace('\r', ' ').replace('\n', ' ');
    }

    private static void reply(final String line)
    {
        System.out.println(line);
        System.out.flush();
    }
}
