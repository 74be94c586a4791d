/*
 * A line-driven Aeron 1.15.1 subscriber for slipstream's interop tests: it holds one subscription
 * (typically a multi-destination subscription, aeron:udp?control-mode=manual), adds and removes
 * its destinations on command and polls it on its own thread.  Aeron's samples never call
 * Subscription.addDestination, hence this program.
 *
 * Properties (-D):
 *   aeron.dir            the driver directory (read by Aeron's client context itself)
 *   mds.channel          the subscription channel (the first program argument, when given, wins)
 *   mds.streamId         stream id (default 10)
 *
 * Each message's first 8 bytes are its index (little-endian int64, as MdcPublisher sends and
 * slipstream's interop tests offer).  The poller counts the messages and checks that each is
 * the one after the last: the first index seen is taken as the start.
 *
 * stdin, one command a line; stdout, one line per command:
 *   add URI        -> "added URI"              Subscription.addDestination(URI)
 *   remove URI     -> "removed URI"            Subscription.removeDestination(URI)
 *   status         -> "status received=N first=F last=L wrong=W images=I"
 *                     N messages, the first and last index (-1: none), W out of sequence
 *                     (missing, repeated or reordered), I images now
 *   quit (or EOF)  -> "bye"                    closes the subscription and the client, exits 0
 * Any command that throws prints "error <message>" (one line) instead.  At start, once the
 * subscription exists: "ready registrationId=R".
 */

import io.aeron.Aeron;
import io.aeron.Subscription;
import io.aeron.logbuffer.FragmentHandler;

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.util.concurrent.atomic.AtomicBoolean;

public final class MdsSubscriber
{
    private long received = 0;
    private long first = -1;
    private long last = -1;
    private long wrong = 0;

    public static void main(final String[] args) throws Exception
    {
        final String channel = args.length > 0 ? args[0] : System.getProperty("mds.channel");
        if (null == channel || channel.isEmpty())
        {
            System.err.println("usage: MdsSubscriber CHANNEL (or -Dmds.channel=CHANNEL)");
            System.exit(2);
        }
        final int streamId = Integer.getInteger("mds.streamId", 10);

        try (Aeron aeron = Aeron.connect(new Aeron.Context());
            Subscription subscription = aeron.addSubscription(channel, streamId))
        {
            final MdsSubscriber subscriber = new MdsSubscriber();
            final AtomicBoolean running = new AtomicBoolean(true);
            final FragmentHandler handler = (buffer, offset, length, header) ->
                subscriber.onMessage(buffer.getLong(offset, ByteOrder.LITTLE_ENDIAN));
            final Thread poller = new Thread(() ->
            {
                while (running.get())
                {
                    final int fragments;
                    synchronized (subscriber)
                    {
                        fragments = subscription.poll(handler, 256);
                    }
                    if (0 == fragments)
                    {
                        Thread.yield();
                    }
                }
            });
            poller.start();
            reply("ready registrationId=" + subscription.registrationId());

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
                    reply(subscriber.execute(subscription, line));
                }
                catch (final Exception ex)
                {
                    reply("error " + oneLine(ex));
                }
            }
            running.set(false);
            poller.join();
        }

        reply("bye");
    }

    private void onMessage(final long index)
    {
        if (first < 0)
        {
            first = index;
        }
        else if (index != last + 1)
        {
            wrong++;
        }
        last = index;
        received++;
    }

    private String execute(final Subscription subscription, final String line)
    {
        final int space = line.indexOf(' ');
        final String command = space < 0 ? line : line.substring(0, space);
        final String argument = space < 0 ? "" : line.substring(space + 1).trim();

        switch (command)
        {
            case "add":
                subscription.addDestination(argument);
                return "added " + argument;

            case "remove":
                subscription.removeDestination(argument);
                return "removed " + argument;

            case "status":
                synchronized (this)
                {
                    return "status received=" + received + " first=" + first + " last=" + last +
                        " wrong=" + wrong + " images=" + subscription.imageCount();
                }

            default:
                throw new IllegalArgumentException("unknown command: " + line);
        }
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
